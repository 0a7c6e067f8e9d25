"""`--quantize int4` (docs/design.md §15): the MatMul weights of the written file as MatMulNBits,
made by onnxruntime's own quantizer (onnxruntime.quantization.matmul_nbits_quantizer, as
onnxruntime-genai's builder makes its int4 folders), the fused norms and everything else as they
are. The quantized file is judged before it takes the float file's place (weights.py: every block
against the float weights; verdict.py: agreement with eager fp32); the deployable folder's
genai_config.json and config files stay beside it, since the graph takes and gives the same tensors.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from ..errors import UsageError


def eligible(model_ir) -> list[str]:
    """Names of the MatMul nodes onnxruntime's quantizer takes: a constant weight B of rank 2 (or
    leading dims of 1), K >= 16."""
    names = []
    for node in model_ir.graph.all_nodes() if hasattr(model_ir.graph, "all_nodes") else model_ir.graph:
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.inputs) < 2:
            continue
        b = node.inputs[1]
        if b is None or b.const_value is None:
            continue
        shape = list(b.const_value.shape)
        if len(shape) >= 2 and all(d == 1 for d in shape[:-2]) and shape[-2] >= 16:
            names.append(node.name)
    return names


def lm_head(model, output: str = "logits") -> str | None:
    """The name of the MatMul (or MatMulNBits) that makes `output` through shape-only ops, None where
    there is none; `model`: an onnx_ir model or a ModelProto."""
    import onnx

    graph = model.graph
    if isinstance(model, onnx.ModelProto):
        producers = {o: (n.op_type, n.name, list(n.input)) for n in graph.node for o in n.output}
    else:
        producers = {o.name: (n.op_type, n.name, [i.name if i is not None else "" for i in n.inputs])
                     for n in graph for o in n.outputs}
    name = output
    for _ in range(8):
        if name not in producers:
            return None
        op, node_name, inputs = producers[name]
        if op in ("MatMul", "MatMulNBits"):
            return node_name
        if op not in ("Reshape", "Cast", "Identity", "Squeeze", "Unsqueeze", "Add") or not inputs:
            return None
        name = inputs[0]
    return None


def refuse_unquantizable(rec) -> None:
    """Before anything is written: a graph with no MatMul weight onnxruntime's quantizer takes is
    refused in one line (exit 2)."""
    if rec.model_ir is None:
        return
    names = eligible(rec.model_ir)
    head = lm_head(rec.model_ir)
    if not rec.quant["lm_head"] and head in names:
        names.remove(head)
    if not names:
        raise UsageError(f"--quantize int4: '{rec.args.model}' exports no MatMul with a constant weight of K >= 16 "
                         "(int4 quantizes MatMul weights as MatMulNBits): leave --quantize out, or use --quantize "
                         "int8 / fp8 with --target trt for Conv / Gemm models")


def transposed_weights(model) -> int:
    """A MatMul whose weight is Transpose(initializer) (a tied LM head: the exporter shares the
    embedding table and transposes it in the graph) gets the transposed weight as an initializer of
    its own, as onnxruntime-genai's builder writes a tied head: onnxruntime's quantizer takes
    constant weights only. The embedding table stays as it is. Returns how many were given one."""
    import numpy as np
    from onnx import helper, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    consumers: dict = {}
    for n in model.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    done = 0
    for node in model.graph.node:
        if node.op_type != "MatMul" or len(node.input) < 2 or node.input[1] in inits:
            continue
        t = producers.get(node.input[1])
        if t is None or t.op_type != "Transpose" or t.input[0] not in inits:
            continue
        w = numpy_helper.to_array(inits[t.input[0]])
        perm = next((list(helper.get_attribute_value(a)) for a in t.attribute if a.name == "perm"), None)
        name = f"{t.input[0]}.transposed_for_{node.name}"
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(np.transpose(w, perm)), name))
        node.input[1] = name
        if len(consumers.get(t.output[0], [])) == 1:  # the Transpose fed this MatMul alone: it goes
            model.graph.node.remove(t)
        done += 1
    return done


def _lazy(path: Path):
    """The file's ModelProto with its external weights left on disk, their locations made absolute:
    onnxruntime's quantizer reads each weight through onnx-ir (memory-mapped, one at a time) and
    the float weights it does not replace stay on disk until the int4 file is written (io.save_ir
    streams them), so the float weights are never all resident (docs/design.md §8)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    folder = Path(path).resolve().parent
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            for entry in t.external_data:
                if entry.key == "location" and not Path(entry.value).is_absolute():
                    entry.value = str(folder / entry.value)
    return model


def quantize(path: Path, opts: dict, exclude: list[str]):
    """onnxruntime's MatMulNBitsQuantizer over the file at `path` (tied weights given their own,
    transposed_weights): the quantized ModelProto."""
    import onnx
    from onnxruntime.quantization import matmul_nbits_quantizer as mnq
    from onnxruntime.quantization.quant_utils import QuantFormat

    config = None  # rtn: the quantizer's DEFAULT (blockwise round to nearest, MLAS), as genai's builder
    if opts["algorithm"] == "hqq":
        config = mnq.HQQWeightOnlyQuantConfig(block_size=opts["block_size"], bits=4, quant_format=QuantFormat.QOperator,
                                              op_types_to_quantize=("MatMul",))
    level = logging.getLogger("onnxruntime.quantization").level
    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)  # its per-node info lines
    try:
        model = _lazy(path)  # the weights stay in the file, each read when the quantizer takes it
        transposed_weights(model)
        q = mnq.MatMulNBitsQuantizer(model, bits=4, block_size=opts["block_size"], is_symmetric=opts["symmetric"],
                                     accuracy_level=opts["accuracy_level"] or None, nodes_to_exclude=exclude,
                                     quant_format=QuantFormat.QOperator, op_types_to_quantize=("MatMul",),
                                     algo_config=config)
        q.process()
    finally:
        logging.getLogger("onnxruntime.quantization").setLevel(level)
    model = q.model.model if hasattr(q.model, "model") else q.model
    _inline(model)
    return model


def _inline(model) -> None:
    """The weights the quantizer left as they were (the embedding table, norm scales, float MatMuls)
    read into the proto: their absolute locations point into the float file's data, which the int4
    file replaces."""
    from onnx.external_data_helper import load_external_data_for_tensor

    import onnx

    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            base = ""
            for entry in t.external_data:
                if entry.key == "location" and Path(entry.value).is_absolute():
                    base, entry.value = str(Path(entry.value).parent), Path(entry.value).name
            load_external_data_for_tensor(t, base)
            t.data_location = onnx.TensorProto.DEFAULT
            del t.external_data[:]


def run(rec):
    """The stage's int4 work on the written file rec.out."""
    import onnx_ir as ir

    from .. import io, llm
    from . import verdict, weights

    opts, out = rec.quant, rec.out
    check = not getattr(rec.args, "no_check", False)
    eager = None
    if rec.task == llm.WITH_PAST:
        # eager fp32's side of the verdict first (its tokens and logits, small), then the torch model and
        # the float file's in-memory copy let go: the quantizer reads the written file, and the model and
        # the float weights need not be resident beside it (docs/design.md §8: the weights held once)
        eager = verdict.eager_reference(rec.module) if check else None
        _release(rec)
    float_ir = ir.load(str(out))  # the float file as written; its external weights read lazily
    exclude = [] if opts["lm_head"] else [n for n in [lm_head(float_ir)] if n]
    t0 = time.perf_counter()
    if rec.prequantized is not None:  # a GPTQ / AWQ / compressed-tensors folder: its packed weights repacked
        from . import prequantized

        proto, _ = prequantized.repack(_lazy(out), rec.prequantized, float_ir, opts)
        _inline(proto)  # (what stays as it was: read into the file, as quantize() does)
        made = f"repacked from the folder's {opts['algorithm']} tensors, no float round trip ("
    else:
        proto = quantize(out, opts, exclude)
        made = f"by onnxruntime's quantizer ({opts['algorithm']}, "
    seconds = time.perf_counter() - t0
    counts = weights.count(proto)
    print(f"quantize int4: {counts['MatMulNBits']} MatMul weight(s) as MatMulNBits {made}block {opts['block_size']}, "
          f"{'symmetric' if opts['symmetric'] else 'asymmetric'}, accuracy level {opts['accuracy_level']}"
          f"{'' if rec.prequantized is not None else '; LM head int4' if opts['lm_head'] else '; LM head float'}), "
          f"{counts['MatMul']} MatMul(s) left in float, {counts['normexport']} normexport / "
          f"{counts['norms']} norm node(s) kept; {seconds:.1f} s")
    # every int4 block against the float weights (weights.py, on every core: numpy releases the GIL), before the
    # int4 file is written, not beside the write: alone it took 1.0 s, beside the write 2.5 s, and the write as
    # long (a 1.1B model, 2-vCPU VM)
    judged = {"weights": weights.check(proto, float_ir, opts)}
    print(judged["weights"].line())
    if not judged["weights"].passed:
        return _failed(rec, out, judged, judged["weights"].line())
    # the weights beside the graph where the float file had them so (an LLM folder's model.onnx.data, as genai's
    # builder writes it): streamed tensor by tensor; one protobuf of a 1.1B model's 0.87 GB took 9.9 s to write
    external = (out.parent / (out.name + ".data")).exists() or None  # (asked before the float file goes)
    # the float file is not kept either way (the int4 file replaces it, or, failed, it is dropped) and nothing
    # reads it now (what the int4 file keeps in float was read into it, _inline): removed on a thread while the
    # int4 file is written, whose pages the freed ones become. Freeing a 1.1B model's 4.1 GB took 0.9 s, which the
    # rename over it paid after the write. Meanwhile the output holds no model file, as after a failure.
    dropping = threading.Thread(target=_drop_quietly, args=(out,), name="normexport-drop-float", daemon=True)
    dropping.start()

    def judge(tmp: Path) -> None:  # the quantized file, written beside the output, judged before it replaces it
        dropping.join()  # (the float file gone before the int4 file takes its names)
        if getattr(rec.args, "no_check", False):
            judged["verdict"] = None
            return
        if rec.task == llm.WITH_PAST:
            # a pre-quantized folder's anchor: genai's builder on the folder itself (it repacks the same tensors)
            source = getattr(rec.args, "prequantized_from", None) or rec.args.model
            # (the builder reads the folder's packing itself; the LM head a writer left in float stays float in both)
            anchor_opts = opts if rec.prequantized is None else {**opts, "algorithm": "rtn", "lm_head": False}
            v = judge_llm_with_anchor(tmp, eager, source, anchor_opts, anchor=not getattr(rec.args, "no_anchor", False))
        else:
            v = verdict.judge_outputs(tmp, rec.module, rec.inputs, rec.names, kind="int4")
        judged["verdict"] = v
        print(v.table())
        if not v.passed:
            raise _Failed("the quantized file FAILED its agreement check (table above)")

    model_ir = ir.serde.deserialize_model(proto)
    try:
        io.save_ir(model_ir, out, validate=judge, external_data=external)
    except _Failed as e:
        return _failed(rec, out, judged, str(e))
    finally:
        dropping.join()
    v = judged.get("verdict")
    rec.quantized = {"kind": "int4", "passed": True, "options": opts, "weights": judged["weights"].to_dict(),
                     "verdict": v.to_dict() if v is not None else None, "seconds": round(seconds, 2)}
    _report(rec)
    print(f"wrote {getattr(rec.args, 'shown_output', None) or out} (int4)")
    return rec


def _release(rec) -> None:
    """A causal LM's record lets go of the torch model and the float file in memory (the last stage:
    nothing after it reads them)."""
    import gc

    rec.module = rec.exportable = rec.unswapped = rec.loaded = None
    rec.model = rec.model_ir = rec.decomposed = None
    if rec.fused is not None:
        rec.fused.model = None
    gc.collect()


def judge_llm_with_anchor(path, lm, source, opts, anchor: bool = True):
    """verdict.judge_llm of the file at `path`, beside onnxruntime-genai's int4 folder of `source`
    where its builder runs here (anchor.py) and `anchor` (--no-anchor: the thresholds)."""
    from . import anchor as anchors, verdict

    if not anchor:
        return verdict.judge_llm(path, lm, anchor=None, anchor_note="none (--no-anchor): judged by the thresholds")
    with anchors.Workdir() as work:
        model, note, _ = anchors.build(source, opts, work)
        if model is None:
            note = f"none ({note}): judged by the thresholds"
        return verdict.judge_llm(path, lm, anchor=model, anchor_note=note)


class _Failed(Exception):
    pass


def _drop(out: Path) -> None:
    """The float file the writing stage wrote: not left where the int4 file was asked for."""
    for p in (out, out.with_name(out.name + ".data")):
        p.unlink(missing_ok=True)


def _drop_quietly(out: Path) -> None:
    """`_drop` on a thread: a file it cannot remove (still open where that forbids it) is left to the rename."""
    try:
        _drop(out)
    except OSError:
        pass


def _failed(rec, out: Path, judged: dict, reason: str):
    """The quantized file failed a check: the float file dropped too, nothing at `out`, exit code 1."""
    _drop(out)
    print(f"quantize int4: {reason}; {out} not written (--no-check writes it without the check)")
    rec.quantized = {"kind": "int4", "passed": False, "weights": judged["weights"].to_dict(),
                     "verdict": judged.get("verdict").to_dict() if judged.get("verdict") else None}
    rec.exit_code = 1
    return rec


def _report(rec) -> None:
    """The --report JSON, written by the writing stage, with the quantized section added."""
    import json

    path = getattr(rec.args, "report", None)
    if not path:
        return
    from .. import io

    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        report = {}
    report["quantized"] = rec.quantized
    source = getattr(rec, "prequantized", None)
    if source is not None:  # the model is the pre-quantized folder; eager ran on its temp float folder
        report["model"] = str(source.folder)
        report["quantized"]["prequantized"] = {"folder": str(source.folder), "method": source.method,
                                               "group_size": source.group, "symmetric": source.info["symmetric"],
                                               "linears": len(source.linears)}
    io.write_json(report, path, "--report")
