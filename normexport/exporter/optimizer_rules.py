"""onnxscript's optimizer (what torch.onnx runs on every dynamo export, and what the exporter
ladder runs itself) with its arithmetic no-op rules matching exact constants only.

onnxscript's `x + 0`, `0 + x`, `x - 0`, `x * 1`, `1 * x` and `x / 1` rules
(onnxscript.rewriter.rules.common._no_op) compare the constant with `math.isclose(rel_tol=1e-5,
abs_tol=1e-8)`, so `s + 1e-15` counts as `s + 0` and is removed: the eps guard of a division
(Sana's DC-AE decoder: `num / (den + 1e-15)`, its linear attention) disappears and 0 / 0 gives NaN
in the file where eager gives a number; `x * 1.000001` goes too. `exact_no_op_rules()` swaps
those rules, for the time of an export or an optimize call, for the same rules on a scalar
constant that is exactly 0 (or 1); every other rule of the optimizer stays as it is.
"""

from __future__ import annotations

import contextlib

import numpy as np


def _exactly(number: float):
    def condition(context, x, c) -> bool:
        const = c.const_value
        if const is None:
            return False
        try:
            a = const.numpy()
        except Exception:  # noqa: BLE001 - external data not at hand: not a constant to judge
            return False
        return a.ndim == 0 and a.dtype.kind in "fiub" and bool(a == number)

    return condition


#: the arithmetic no-op patterns, (name, pattern, the constant that makes it a no-op)
_NO_OPS = (("add", lambda op, x, c: op.Add(x, c), 0.0), ("add_left", lambda op, x, c: op.Add(c, x), 0.0),
           ("sub", lambda op, x, c: op.Sub(x, c), 0.0), ("mul", lambda op, x, c: op.Mul(x, c), 1.0),
           ("mul_left", lambda op, x, c: op.Mul(c, x), 1.0), ("div", lambda op, x, c: op.Div(x, c), 1.0))


def _identity(op, x, c):
    return op.Identity(x)


def exact_rules() -> list:
    """The arithmetic no-op rules, on exact scalar constants."""
    from onnxscript.rewriter import pattern

    return [pattern.RewriteRule(target, _identity, _exactly(number), name=f"exact_{name}")
            for name, target, number in _NO_OPS]


@contextlib.contextmanager
def exact_no_op_rules():
    """onnxscript's default rewrite rules with the loose arithmetic no-op rules replaced by
    exact_rules() (the Dropout no-op rules kept), restored on exit."""
    import onnxscript.rewriter as rewriter
    from onnxscript.rewriter.rules.common import _no_op

    original = rewriter._DEFAULT_REWRITE_RULES
    keep = {id(_no_op.dropout_zero_rule), id(_no_op.dropout_inference_rule)}
    loose = {id(r) for r in _no_op.rules} - keep
    rewriter._DEFAULT_REWRITE_RULES = (*exact_rules(), *(r for r in original if id(r) not in loose))
    try:
        yield
    finally:
        rewriter._DEFAULT_REWRITE_RULES = original
