"""convert's attention fusion and generation check for a KV-cache file of any size, run from files
(issue 31 part B; docs/design.md §8, §10): what convert does in memory up to 2 GiB of weights, by path.

    checked = bypath.fuse_and_check(model_ir, lm, out, fuse=..., check=...)
    try:
        ... (report; on failure nothing is placed)
        checked.place(validate=io.check_onnx_path)   # instead of io.save_ir(model_ir, out)
    finally:
        checked.close()

The decomposed file is written once into a temporary folder beside `out` (its weights streamed
into `<out>.data`); the fused copy shares them (files.Workdir), so the weights reach the disk once
and the file kept takes the output's place by renames. onnxruntime loads each file by path, one
session at a time; the eager model stays (the generation check's reference) and the float64
reference of a model too large for a float64 copy upcasts one module at a time.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import onnx_ir as ir

from . import attention
from .files import Workdir


@dataclasses.dataclass
class Checked:
    """The outcome: `model_ir` is the model kept (fused, or the decomposed one), `name` its file
    in `workdir`; `fusion` (None where not tried) and `generation` (None with check=False) as
    convert reports them; `passed` whether the file may be written."""

    workdir: Workdir
    model_ir: ir.Model
    name: str
    fusion: attention.Fusion | None = None
    generation: object | None = None  # parity.generate.GenerationReport

    @property
    def passed(self) -> bool:
        return self.generation is None or self.generation.passed

    @property
    def path(self) -> Path:
        return self.workdir.files[self.name]

    def place(self, validate=None) -> Path:
        """The kept file becomes the output (`<out>` and `<out>.data`), by renames; `validate(path)`
        (io.check_onnx_path) runs on it first."""
        return self.workdir.place(self.name, validate=validate)

    def close(self) -> None:
        self.workdir.close()


def fuse_and_check(model_ir: ir.Model, lm, out, *, fuse: bool = True, check: bool = True,
                   plain_export=None, workdir: Workdir | None = None, eager=None) -> Checked:
    """The attention fused (`fuse`: convert --target ort of a causal LM with its cache, the fusion
    not turned off) and verified, and the greedy generation check (`check`: not --no-check), run
    from files in a Workdir beside `out`. Prints convert's lines: the attention line and the
    generation table(s) (a failed check on the fused file: its table, then the decomposed file's).
    `lm`: the CacheLM the file was exported from (kept: the generation check's eager reference).
    `workdir`: a Workdir whose data file holds (or is being written with) `model_ir`'s weights
    (Workdir.write_data_behind), taken over; else a new one. `eager`: the fusion's local check's eager
    steps started earlier (verify.EagerForked: convert.prewrite), stopped where not used."""
    from ..parity.generate import check_generation_ir

    wd = workdir if workdir is not None else Workdir(out)
    try:
        result = Checked(wd, model_ir, wd.decomposed)
        fused = None
        sessions: dict = {}  # the fused file's session from the local check, run again by the generation check
        if not fuse and eager is not None:
            eager.stop()
        if fuse:
            fused = result.fusion = attention.for_convert(model_ir, lm, workdir=wd, sessions=sessions, eager=eager)
            eager = None
            if fused.local.get("eager_failed"):  # the decomposed file itself is not eager's: the caller exports again
                print(attention.line(fused))
                sessions.clear()
                return result
            if fused.model is None or not check:
                print(attention.line(fused, None if check else "generation check not run (--no-check)"))
            if fused.model is not None:
                result.model_ir, result.name = fused.model, out_name(wd)
        if not check:
            sessions.clear()
            if result.name not in wd.files:
                wd.write(result.model_ir, result.name)
            return result

        def generation(model, name, session=None):
            return check_generation_ir(model, lm, wd, name=name, command="convert", plain_export=plain_export,
                                       session=session)

        gen = generation(result.model_ir, result.name, sessions.pop("fused", None) if fused and fused.model else None)
        sessions.clear()
        if fused is not None and fused.model is not None:  # the generation check is the fusion's verification
            if not gen.passed:  # never silent: the failed check shown, the decomposed file checked and kept
                print(gen.table())
                fused.model, fused.reason = None, "the fused file FAILED the generation check (table above)"
                result.model_ir, result.name = model_ir, wd.decomposed
                gen = generation(model_ir, wd.decomposed)
            print(attention.line(fused, "generation check PASSED on the fused file" if fused.model else None))
        print(gen.table())
        result.generation = gen
        return result
    except BaseException:
        if eager is not None:
            eager.stop()
        wd.close()
        raise


def out_name(wd: Workdir) -> str:
    return wd.out.name
