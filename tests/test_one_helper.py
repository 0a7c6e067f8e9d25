"""Helpers written once (issue 39 item 4): the constant behind a value, same_dim / same_shape
(normexport/ir_utils.py), the float element types (normexport/dtypes.py) and the exporter ladder's rung
names (normexport/exporter/names.py) are defined in one place; a copy elsewhere fails here.

Each check reads the package's sources with ast (nothing is imported) and is also run on a planted
copy, so a check that no longer sees anything fails too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "normexport"

#: where each helper lives
IR_UTILS = "ir_utils.py"
DTYPES = "dtypes.py"
RUNG_NAMES = "exporter/names.py"

_HELPER_NAMES = {"constant_array", "constant_node_array", "const_array", "const", "_const", "_constant_attr",
                 "same_shape", "_same_shape", "same_dim", "_same_dim"}
_FLOATS = {"FLOAT", "FLOAT16", "BFLOAT16", "DOUBLE"}
_RUNGS = {"dynamic", "static axes", "fewer axes", "static", "torchscript", "torchscript static"}


def _sources() -> dict[str, str]:
    return {p.relative_to(PKG).as_posix(): p.read_text() for p in sorted(PKG.rglob("*.py"))}


def _reads_a_constant(fn: ast.FunctionDef) -> bool:
    """A function that reads a value's constant: it looks at `.const_value`, compares an op type with
    "Constant" (a producer it reads, not a node it makes) and turns a tensor into numpy."""
    names = {n.attr for n in ast.walk(fn) if isinstance(n, ast.Attribute)}
    compared = {n.value for c in ast.walk(fn) if isinstance(c, ast.Compare) for n in ast.walk(c)
                if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    return "const_value" in names and "Constant" in compared and "numpy" in names


def _calls_ir_utils(fn: ast.FunctionDef) -> bool:
    """A def that calls the ir_utils helper (a caller's binding of it, e.g. with its keywords), not a copy."""
    called = {c.func.id if isinstance(c.func, ast.Name) else getattr(c.func, "attr", None)
              for c in ast.walk(fn) if isinstance(c, ast.Call)}
    return bool(called & {"constant_array", "constant_node_array", "same_shape", "same_dim"})


def helper_copies(sources: dict[str, str]) -> list[str]:
    """`file:line name` of each def of the constant / same-shape helpers outside ir_utils.py (a def that
    only calls the ir_utils one is a binding of it, not a copy)."""
    out = []
    for rel, text in sources.items():
        if rel == IR_UTILS:
            continue
        for fn in ast.walk(ast.parse(text)):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                    (fn.name in _HELPER_NAMES or _reads_a_constant(fn)) and not _calls_ir_utils(fn):
                out.append(f"{rel}:{fn.lineno} {fn.name}")
    return out


def _members(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
        return list(node.elts)
    if isinstance(node, ast.Dict):
        return [k for k in node.keys if k is not None]
    return []


def float_sets(sources: dict[str, str]) -> list[str]:
    """`file:line` of each set / tuple / list of all four float element types (X.FLOAT, X.FLOAT16,
    X.BFLOAT16, X.DOUBLE) outside dtypes.py."""
    out = []
    for rel, text in sources.items():
        if rel == DTYPES:
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Set, ast.Tuple, ast.List)):
                attrs = {e.attr for e in node.elts if isinstance(e, ast.Attribute)}
                if _FLOATS <= attrs:
                    out.append(f"{rel}:{node.lineno}")
    return out


def rung_tables(sources: dict[str, str]) -> list[str]:
    """`file:line` of each literal (tuple, list, set, dict keys) naming three or more of the ladder's
    rungs outside exporter/names.py."""
    out = []
    for rel, text in sources.items():
        if rel == RUNG_NAMES:
            continue
        for node in ast.walk(ast.parse(text)):
            named = {e.value for e in _members(node) if isinstance(e, ast.Constant) and e.value in _RUNGS}
            if len(named) >= 3:
                out.append(f"{rel}:{node.lineno}")
    return out


def test_the_constant_and_shape_helpers_are_defined_once():
    copies = helper_copies(_sources())
    assert copies == [], f"define these once, in normexport/{IR_UTILS}, and import them: {copies}"


def test_the_float_types_are_defined_once():
    sets = float_sets(_sources())
    assert sets == [], f"read normexport.dtypes.FLOAT_TYPES instead of a set of your own: {sets}"


def test_the_rung_names_are_defined_once():
    tables = rung_tables(_sources())
    assert tables == [], f"read normexport/{RUNG_NAMES} (LADDER, RUNG_TEXT, RUNG_SUMMARY) instead: {tables}"


def test_the_homes_hold_them():
    src = _sources()
    assert {"constant_array", "same_shape", "same_dim"} <= {
        f.name for f in ast.walk(ast.parse(src[IR_UTILS])) if isinstance(f, ast.FunctionDef)}
    assert float_sets({"x.py": src[DTYPES]}) == ["x.py:" + str(next(
        n.lineno for n in ast.walk(ast.parse(src[DTYPES])) if isinstance(n, ast.Set)))]
    assert rung_tables({"x.py": src[RUNG_NAMES]})


_PLANTED_CONST = '''
def value_array(v):
    if v.const_value is not None:
        return v.const_value.numpy()
    p = v.producer()
    if p is not None and p.op_type == "Constant":
        return p.attributes["value"].as_tensor().numpy()
'''
_PLANTED_SHAPE = '''
def _same_shape(a, b):
    return a == b
'''
_PLANTED_FLOATS = "F = (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE)\n"
_PLANTED_RUNGS = 'T = {"dynamic": "a", "static axes": "b", "static": "c", "torchscript": "d"}\n'


@pytest.mark.parametrize("check, planted", [(helper_copies, _PLANTED_CONST), (helper_copies, _PLANTED_SHAPE),
                                            (float_sets, _PLANTED_FLOATS), (rung_tables, _PLANTED_RUNGS)])
def test_a_planted_copy_is_found(check, planted):
    src = _sources()
    src["rewriter/planted.py"] = planted
    assert [c for c in check(src) if c.startswith("rewriter/planted.py:")], planted
