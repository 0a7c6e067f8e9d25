"""The one record `normexport convert` passes through its stages (load -> inputs -> prepare ->
export ladder (rewrite, check as its judge) -> attention -> check -> write): each stage takes it
and returns it, none calls back up (normexport/convert/__init__.py runs them in order)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

#: convert's whole-model parity check (eager, the file in onnxruntime, the float64 reference and
#: perhaps the plain export, all resident) runs for models with at most this many bytes of weights
#: (read at call time: tests lower it)
PARITY_LIMIT = 2 << 30

#: a causal LM with its cache over PARITY_LIMIT is fused and checked by greedy generation from files
#: (one onnxruntime session at a time beside the eager model) when its weights take at most this
#: share of the memory available then; larger ones say so and leave the check to `normexport check`
BYPATH_MEMORY_SHARE = 0.6


def available_memory() -> int | None:
    """Bytes of memory available now (Linux MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


#: the first opset whose Conv / Gemm / MatMul / Pow ... accept bfloat16; `--dtype bfloat16` exports
#: at it unless --opset says otherwise
BF16_OPSET = 22


@dataclasses.dataclass
class Record:
    args: argparse.Namespace
    # loading: where the file goes, the fusions turned off, what was loaded, the task of a causal LM
    out: Path | None = None
    off: dict = dataclasses.field(default_factory=dict)
    loaded: Any = None
    task: str | None = None
    input_args: list = dataclasses.field(default_factory=list)  # --input, as the task resolved them
    # inputs: the module called as the export calls it, its inputs, names, dynamic axes, outputs
    module: Any = None
    inputs: tuple = ()
    names: list = dataclasses.field(default_factory=list)
    dynamic: dict = dataclasses.field(default_factory=dict)
    output_names: list | None = None
    output_structure: dict | None = None  # normexport.load.call.describe of the eager output
    opset: int | None = None
    # prepare: the module the ladder exports, and the same before the norm swaps (TorchScript rungs)
    exportable: Any = None
    unswapped: Any = None
    sections: dict = dataclasses.field(default_factory=dict)  # the report's prepare / exporter sections
    # export ladder: one exported file (an onnx_ir model), the axes it keeps dynamic, its rewrite report
    model_ir: Any = None
    kept: dict = dataclasses.field(default_factory=dict)
    rewrite: dict | None = None
    # check: the file as one protobuf (where it fits; checked by the ONNX checker), the check's result
    model: Any = None
    result: Any = None
    checked: bool = False  # the result belongs to this model_ir (judged on the ladder)
    passed: bool = True
    parity_note: str | None = None  # why the whole-model check did not run here
    fused: Any = None  # the attention fusion (normexport.llm.attention.Fusion), with the file it replaced
    decomposed: tuple | None = None
    packing: Any = None  # the packed projections (normexport.llm.packing.Packing)
    bypath: Any = None  # a causal LM over PARITY_LIMIT checked from files (normexport.llm.bypath.Checked)
    prewrite: Any = None  # its weights written ahead: the run's owner of them (normexport.convert.prewrite.Prewrite)
    quant: dict | None = None  # --quantize's options (normexport.quantize.options), None without it
    quantized: Any = None  # the quantized file's verdict (normexport.quantize), after writing
    prequantized: Any = None  # a GPTQ / AWQ / compressed-tensors folder's packed weights (normexport.quantize.prequantized)
    exit_code: int = 0

    def copy(self) -> "Record":
        """This record for an attempt of its own (convert: the exporting and attention stages, tried
        again from the record as they found it): its dicts and lists copied, everything else (the
        model, its weights, the loaded files) shared, never copied (docs/design.md §8: the weights held once)."""
        return dataclasses.replace(self, **{f.name: _fresh(getattr(self, f.name)) for f in dataclasses.fields(self)
                                            if isinstance(getattr(self, f.name), (dict, list))})

    @property
    def ladder_check(self) -> bool:
        """The ladder's judge runs the parity check (not for --no-check; a causal LM with its cache
        is checked by greedy generation once, after the ladder)."""
        from .. import llm

        return not self.args.no_check and self.task != llm.WITH_PAST

    def plain_export(self, output_names=None):
        """docs/design.md §7: the plain torch.onnx export of the same call, built only when a check needs it."""
        from ..parity.plain import builder

        return builder(self.module, self.inputs, input_names=self.names, output_names=output_names,
                       dynamic_axes=self.kept, opset=self.opset)


def _fresh(value):
    """`value`'s dicts and lists copied all the way down (report sections, axes, names), the rest shared."""
    if isinstance(value, dict):
        return {k: _fresh(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_fresh(v) for v in value]
    return value
