"""The plain export (docs/design.md §7): the same model through torch.onnx with no normexport changes (no
BN folding, no norm swaps, no rewrites), run by the same backend as the checked file. Built only
when a row fails the 2x-eager rule, once per check; its outputs are kept per backend and shape."""

from __future__ import annotations

import time
from typing import Callable

import onnx

from . import runners
from ._util import _short
from .verdict import max_abs_error

#: what check(plain_export=...) takes: a function building the plain export, True (check builds it
#: from the reference, see `builder`), or None (no plain-export rule)
Build = Callable[[], onnx.ModelProto]


def builder(reference, inputs: tuple, *, input_names: list[str], output_names: list[str] | None,
            dynamic_axes: dict[str, list[int]], opset: int | None) -> Build:
    """A Build for `reference` called with `inputs` (already in the checked dtype), with the
    checked file's input names, dynamic axes and opset (outputs are matched by position)."""

    def build() -> onnx.ModelProto:
        from ..export import convert_module

        return convert_module(reference, tuple(inputs), target="onnx", opset=opset, input_names=input_names,
                              output_names=output_names, dynamic_axes=dynamic_axes or None,
                              fold_bn=False, swap_norms=False, rewrite=False)

    return build


def opset_of(model: onnx.ModelProto) -> int | None:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)


class PlainExport:
    """Errors of the plain export per backend x shape x output, computed on first demand."""

    def __init__(self, build: Build | None, plugin: str | None, names: list[str], first_shape: dict[str, list[int]]):
        self._build = build
        self._plugin = plugin
        self._names = names
        self._first_shape = first_shape
        self._source: runners._ModelSource | None = None
        self._runners: dict[str, object] = {}
        self._outputs: dict[tuple[str, int], list | str] = {}
        self.info: dict = {}  # for the report: {} when never needed, else {"built": ..., "reason"? ...}

    def _model(self) -> runners._ModelSource | None:
        if self._source is None and not self.info:
            if self._build is None:
                self.info = {"built": False, "reason": "none was given (check(plain_export=...))"}
                return None
            t = time.perf_counter()
            try:
                self._source = runners._ModelSource(self._build())
                self.info = {"built": True, "seconds": round(time.perf_counter() - t, 2)}
            except Exception as e:
                self.info = {"built": False, "reason": f"could not be built ({type(e).__name__}: {_short(e)})"}
        return self._source

    def _run(self, backend: str, k: int, xs) -> list | str:
        """The backend's outputs on the plain export at shape case `k`, or why there are none."""
        if (backend, k) in self._outputs:
            return self._outputs[(backend, k)]
        source = self._model()
        if source is None:
            return self.info["reason"]
        try:
            if backend not in self._runners:
                runner = runners.runner_for(backend, source, plugin=self._plugin, first_shape=self._first_shape,
                                            names=self._names)
                runner.activate()
                self._runners[backend] = runner
            out = list(self._runners[backend].infer(xs))
        except Exception as e:
            out = f"{backend} could not run it ({type(e).__name__}: {_short(e)})"
        self._outputs[(backend, k)] = out
        return out

    def error(self, backend: str, k: int, xs, j: int, ref64) -> tuple[float | None, str | None]:
        out = self._run(backend, k, xs)
        if isinstance(out, str):
            return None, out
        if j >= len(out):
            return None, f"the plain export has {len(out)} output(s), the file more"
        err = max_abs_error(out[j], ref64)
        if err is None:
            return None, "the plain export's output has another shape"
        return err, None

    def close(self):
        if self._source is not None:
            self._source.close()
