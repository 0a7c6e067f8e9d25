"""The exporter ladder (docs/design.md §9): rungs tried in order, the first file that exports and that the
judge accepts is kept.

The judge is the caller's: `judge(model, kept_axes) -> (accepted, value)` gets each exported file
(an onnx_ir model) with the axes it keeps dynamic, and returns whether to keep it and what the
caller wants back for it (convert: its record after the rewrite and parity stages; the API: the
rewritten model and its rewrite report). The ladder never looks at a file after handing it over.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import AxesFixed, ExportError, UsageError
from . import rungs
from .names import LADDER, RUNG_TEXT  # noqa: F401 - the rungs, in order, and their names (exporter/names.py)

Judge = Callable[[Any, dict], "tuple[bool, Any]"]


def run(module, unswapped, args: tuple, *, names: list[str], output_names, dynamic_axes, opset: int, ts_opset: int,
        target: str, auto_dynamic: bool, judge: Judge, report: dict, plan=None, fewer=(), required=None) -> Any:
    """Export `module` (prepared; `unswapped`: before the norm swaps, for the TorchScript rungs)
    rung by rung (LADDER): the dynamo exporter with `dynamic_axes`; then with the axes it cannot
    keep made static (torch.export's Dim.AUTO: the file's symbolic dims say which stayed); then
    with static shapes; then the TorchScript-based exporter with the axes, then static. A rung
    whose export raises (or whose file fails the ONNX checker or onnxruntime) gives way to the
    next, so does a file the judge refuses. Returns the judge's value for the first file accepted
    (when none is: for the first file, with "parity_failed" in the section) and sets
    report["exporter"] ("name", "rung", "static_axes", "dynamo_error", "attempts", ...). `plan`
    (exporter.depth.Plan): the first rung exports the module's stack of blocks shallow and grows it.
    `fewer`: narrower sets of the axes, tried in order ("fewer axes") before the fully static rung: one
    ladder instead of a whole convert per set (a pipeline component whose latent size cannot stay
    dynamic keeps its batch). `required` ({input: axes} within dynamic_axes): axes the caller serves
    another way where the model fixes them (a pipeline's text axis, padded: pipeline/padding.py): the
    first rung that would export without one of them raises AxesFixed instead, as does a file that
    does not keep them, so no file is exported in vain."""
    wanted = {n: sorted(set(a)) for n, a in (dynamic_axes or {}).items() if a}
    narrower = _narrower(fewer, wanted)
    attempts: list[dict] = []
    fixed: dict[str, list[int]] = {}  # axes a failed export said the model fixes (torch.export's conflicts)
    tried: list[dict] = []  # axis sets already exported (and refused or failed): not exported again
    first_failed = None  # (value, exporter section) of the first file that exported but was refused
    for rung, subset in [(r, s) for r in LADDER for s in (narrower if r == "fewer axes" else [None])]:
        if rung != "dynamic" and rung != "torchscript" and not wanted:
            continue  # no dynamic axes: the first rung is already static
        if rung == "static axes" and auto_dynamic:
            continue  # the first rung already let torch.export make static what it could not keep
        if rung == "static" and any(a.get("rung") == "static axes" and a.get("kept") == {} for a in attempts):
            continue  # the previous rung already wrote a fully static file
        if rung == "torchscript static" and not wanted:
            continue
        keep = None  # the axes this rung asks torch.export to keep
        if required and rung == "static axes":
            try:
                keep = _keepable(module, args, names, wanted, fixed)
            except UsageError:
                raise
            except Exception:  # noqa: BLE001 - torch.export cannot say which axes it keeps: none, as its rung would
                keep = {}
        _give_up(required, _asked(rung, wanted, keep, _minus(subset or {}, fixed)), attempts, fixed)
        try:
            if rung == "dynamic":
                model = rungs.dynamo(module, args, names, output_names, dynamic_axes, opset, target=target,
                                     auto=auto_dynamic, report=report, plan=plan)
            elif rung == "static axes":
                # the axes the first rung's failure named as fixed by the model, else torch.export's Dim.AUTO trace
                if keep is None:
                    keep = _keepable(module, args, names, wanted, fixed)
                if keep == wanted:  # torch.export keeps them all: the first rung's file again
                    attempts.append({"rung": rung, "skipped": "torch.export keeps every dynamic axis"})
                    continue
                if keep in tried:
                    attempts.append({"rung": rung, "skipped": "the same axes as a file already refused"})
                    continue
                model = rungs.dynamo(module, args, names, output_names, keep, opset, target=target, fresh=True,
                                     report=report)
            elif rung == "fewer axes":
                keep = _minus(subset, fixed)  # never ask again for an axis the model was seen to fix
                if not keep or keep in tried:
                    why = f"the model fixes {_axes_text(subset)}" if not keep else "the same axes as a file already refused"
                    attempts.append({"rung": rung, "axes": subset, "skipped": why})
                    continue
                subset = keep
                model = rungs.dynamo(module, args, names, output_names, subset, opset, target=target, fresh=True,
                                     report=report)
            elif rung == "static":
                model = rungs.dynamo(module, args, names, output_names, None, opset, target=target, fresh=True,
                                     report=report)
            elif rung == "torchscript":
                model = rungs.torchscript(unswapped, args, names, output_names, dynamic_axes, ts_opset, target=target)
            else:
                model = rungs.torchscript(unswapped, args, names, output_names, None, ts_opset, target=target)
        except UsageError:
            raise
        except Exception as e:
            if rung == "dynamic" and "unsupported type: tensor(bfloat16)" in str(e):
                raise  # an op without a bfloat16 form at this opset: the opset is the fix, not another exporter
            attempts.append({"rung": rung, **({"axes": subset} if subset else {}), "error": rungs.cause_summary(e)})
            named = rungs.specialised_axes(e, module, names)
            if named:  # said in the user's names: which axes the model's code fixes
                attempts[-1]["error"] = f"torch.export: the model fixes {_axes_text(named)}"
                for n, axes in named.items():
                    fixed[n] = sorted(set(fixed.get(n, [])) | set(axes))
            if keep is not None:
                tried.append(keep)
            continue
        kept = rungs.file_dynamic_axes(model)
        _give_up(required, kept, attempts, fixed)
        static_axes = {n: [a for a in axes if a not in kept.get(n, [])] for n, axes in wanted.items()}
        static_axes = {n: axes for n, axes in static_axes.items() if axes}
        section = _section(rung, attempts, static_axes, ts_opset)
        accepted, value = judge(model, kept)
        del model  # the judge's value holds what the caller keeps
        if accepted:
            report["exporter"] = section
            return value
        attempts.append({"rung": rung, **({"axes": subset} if subset else {}), "parity": "failed", "kept": kept})
        tried.append(kept)
        if first_failed is None:
            first_failed = (value, section)
        else:
            del value
    if first_failed is not None:  # every file refused: the first (most dynamic) one, said so
        report["exporter"] = {**first_failed[1], "parity_failed": True, "attempts": attempts}
        return first_failed[0]
    causes = "; ".join(f"{RUNG_TEXT[a['rung']]}: {a['error']}" for a in attempts if "error" in a)
    from ..prepare.complex import not_lowered  # why complex values were left in the model (§9)

    causes += "".join(f"; {why}" for why in not_lowered(report.get("prepare")))
    raise ExportError(f"torch.onnx cannot export the model: {causes}") from None


def _keepable(module, args, names, wanted: dict, fixed: dict) -> dict:
    """The axes the static-axes rung asks for: the wanted ones but those the first rung's failure named as fixed
    by the model, else torch.export's Dim.AUTO trace of which it keeps."""
    return _minus(wanted, fixed) if fixed else rungs.keepable_axes(module, args, names, wanted)


def _asked(rung: str, wanted: dict, keep: dict | None, fewer: dict) -> dict:
    """The axes `rung` asks the exporter to keep: every wanted axis (the dynamic and TorchScript rungs), the
    keepable ones (static axes), the narrower set (fewer axes), none (the static rungs)."""
    if rung == "static axes":
        return keep or {}
    if rung == "fewer axes":
        return fewer
    return wanted if rung in ("dynamic", "torchscript") else {}


def _give_up(required, asked: dict, attempts: list[dict], fixed: dict) -> None:
    """AxesFixed where `asked` (a rung's axes, or a file's) lacks a `required` axis (run's doc)."""
    lost = _minus(required or {}, asked)
    if lost:
        why = "; ".join(f"{RUNG_TEXT[a['rung']]}: {a['error']}" for a in attempts if "error" in a)
        raise AxesFixed(f"no exporter keeps {_axes_text(lost)} dynamic" + (f" ({why})" if why else ""), lost, fixed)


def _narrower(fewer, wanted: dict) -> list[dict]:
    """The caller's narrower axis sets, each within `wanted`, non-empty, smaller, once each, in order."""
    out: list[dict] = []
    for axes in fewer or ():
        sub = {n: sorted(set(a) & set(wanted.get(n, []))) for n, a in (axes or {}).items()}
        sub = {n: a for n, a in sub.items() if a}
        if sub and sub != wanted and sub not in out:
            out.append(sub)
    return out


def _minus(axes: dict, fixed: dict) -> dict[str, list[int]]:
    """`axes` without those in `fixed`, inputs left with none dropped."""
    out = {n: [a for a in ax if a not in fixed.get(n, [])] for n, ax in axes.items()}
    return {n: a for n, a in out.items() if a}


def _axes_text(axes: dict) -> str:
    return ", ".join(f"{n}:{','.join(map(str, a))}" for n, a in axes.items())


def _section(rung: str, attempts: list[dict], static_axes: dict, ts_opset: int) -> dict:
    """The report's "exporter" section: which rung wrote the file, which axes it made static and why
    the rungs above it were not kept."""
    name = "torchscript" if rung.startswith("torchscript") else "dynamo"
    section: dict = {"name": name, "rung": rung, "static_axes": static_axes}
    if static_axes:
        section["static"] = True
    if name == "torchscript":
        section["opset"] = ts_opset
    errors = [a for a in attempts if "error" in a]
    dyn = next((a for a in attempts if a["rung"] == "dynamic"), None)
    if dyn is not None:
        section["dynamo_error"] = dyn.get("error") or "parity failed at other sizes"
        section["dynamic_error"] = section["dynamo_error"]
    ts = next((a for a in errors if a["rung"] == "torchscript"), None)
    if ts is not None:
        section["torchscript_error"] = ts["error"]
    if attempts:
        section["attempts"] = attempts
    return section
