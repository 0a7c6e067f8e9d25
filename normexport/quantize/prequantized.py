"""A folder already quantized (docs/design.md §15, issue 45 item 1): config.json's
`quantization_config` names GPTQ, AWQ or compressed-tensors' pack-quantized int4. Its packed
weights go to MatMulNBits as they are (repacked, never through float), as onnxruntime-genai's
builder does; the eager model the export and the verdict need is the folder's dequantized weights
(those are the model), written into a temporary float folder that `convert` loads instead.

Each format read here into one standard form per Linear (`Packed`: q [N, K] 0..15, zero [N, G]
0..15, scale [N, G], W = (q - zero[k // group]) * scale[k // group]):

    gptq                qweight int32 [K/8, N], 8 values along K per word, low nibble first;
                        qzeros int32 [G, N/8] along N, stored as zero - 1 (checkpoint_format gptq,
                        the default) or as zero (gptq_v2); scales [G, N]; g_idx [K] must be
                        k // group_size (act-order is refused)
    awq (version gemm)  qweight int32 [K, N/8] and qzeros [G, N/8] along N in AutoAWQ's interleaved
                        order (nibble i holds column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i]); scales [G, N]
    compressed-tensors  weight_packed int32 [N, K/8] along K, low nibble first, values stored + 8;
    (pack-quantized)    weight_zero_point int32 [N/8, G] along N, + 8 (absent: symmetric);
                        weight_scale [N, G]

Anything else (another method, bits != 4, a group size MatMulNBits has no block for, act-order,
activation quantization) is refused in one line before anything is loaded or written (exit 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np

from ..errors import UsageError

SUPPORTED = ("gptq (bits 4, desc_act false, checkpoint_format gptq or gptq_v2), awq (bits 4, version gemm, "
             "zero_point true), compressed-tensors (format pack-quantized, int 4-bit weights, strategy group, "
             "no activation quantization); group size 16, 32, 64, 128 or 256")
GROUPS = (16, 32, 64, 128, 256)  # MatMulNBits' block sizes
#: AutoAWQ's interleave: the nibble that holds column j of each group of 8 (the inverse of its pack order
#: [0, 2, 4, 6, 1, 3, 5, 7])
AWQ_NIBBLE_OF = np.array([0, 4, 1, 5, 2, 6, 3, 7])
SHIFTS = np.arange(8, dtype=np.uint32) * 4
#: the tensor each format keeps per quantized Linear (its name's suffix)
MARKER = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}


@dataclasses.dataclass
class Packed:
    """One Linear's int4 weights in the standard form: W[n, k] = (q[n, k] - zero[n, k // group]) * scale[n, k // group]."""

    q: np.ndarray  # uint8 [N, K], 0..15
    zero: np.ndarray  # uint8 [N, G], 0..15
    scale: np.ndarray  # float32 [N, G] (exact: the stored fp16 / bf16 / fp32 scales)
    group: int

    @property
    def n(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1]

    def dequantized(self) -> np.ndarray:
        """W [N, K] float32: exact ((q - zero) is an integer of |.| <= 15 and the scale has <= 24 bits of mantissa
        to spare for it only when it came as fp16 / bf16, as every writer here stores it)."""
        g = np.arange(self.k) // self.group
        return ((self.q.astype(np.float32) - self.zero[:, g].astype(np.float32)) * self.scale[:, g]).astype(np.float32)


def _nibbles(words: np.ndarray, axis: int) -> np.ndarray:
    """int32 words -> their 8 nibbles (low first) along `axis` (the axis grows 8x)."""
    w = words.astype(np.int64).astype(np.uint32)
    nib = ((w[..., None] >> SHIFTS) & 0xF).astype(np.uint8)  # [..., 8]
    nib = np.moveaxis(nib, -1, axis + 1) if axis != w.ndim - 1 else nib
    shape = list(w.shape)
    shape[axis] *= 8
    return nib.reshape(shape)


def unpack_gptq(qweight, qzeros, scales, g_idx, group: int, v1: bool) -> Packed:
    q = _nibbles(qweight, 0)  # [K, N]
    z = _nibbles(qzeros, 1)  # [G, N]
    if v1:  # GPTQ (v1) stores zero - 1
        z = ((z.astype(np.int16) + 1) & 0xF).astype(np.uint8)
    k = q.shape[0]
    if g_idx is not None and not np.array_equal(np.asarray(g_idx).astype(np.int64), np.arange(k) // group):
        raise UsageError("a GPTQ weight with act-order (g_idx is not k // group_size): MatMulNBits takes groups of "
                         f"consecutive rows; supported pre-quantized folders are {SUPPORTED}")
    return Packed(q=np.ascontiguousarray(q.T), zero=np.ascontiguousarray(z[:, : q.shape[1]].T),
                  scale=np.ascontiguousarray(np.asarray(scales, dtype=np.float32).T), group=group)


def unpack_awq(qweight, qzeros, scales, group: int) -> Packed:
    def columns(words):
        nib = _nibbles(words, words.ndim - 1).reshape(words.shape[0], -1, 8)  # [rows, N/8, nibble]
        return nib[:, :, AWQ_NIBBLE_OF].reshape(words.shape[0], -1)  # column 8c + j from nibble AWQ_NIBBLE_OF[j]

    q, z = columns(qweight), columns(qzeros)  # [K, N], [G, N]
    return Packed(q=np.ascontiguousarray(q.T), zero=np.ascontiguousarray(z.T),
                  scale=np.ascontiguousarray(np.asarray(scales, dtype=np.float32).T), group=group)


def unpack_compressed(packed, zero_point, scale, shape, group: int) -> Packed:
    n, k = (int(d) for d in shape)
    q = _nibbles(packed, 1)[:, :k]  # [N, K]
    scale = np.asarray(scale, dtype=np.float32)
    if zero_point is None:
        z = np.full(scale.shape, 8, dtype=np.uint8)
    else:
        z = _nibbles(zero_point, 0)[:n]  # [N, G]
    return Packed(q=np.ascontiguousarray(q), zero=np.ascontiguousarray(z), scale=scale, group=group)


# -- the folder ---------------------------------------------------------------------------------------------


def quantization_config(folder) -> dict | None:
    """config.json's quantization_config of a transformers folder, None where there is none."""
    p = Path(str(folder))
    if not (p.is_dir() and (p / "config.json").is_file()):
        return None
    try:
        cfg = json.loads((p / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = cfg.get("quantization_config") if isinstance(cfg, dict) else None
    return q if isinstance(q, dict) else None


def describe(qc: dict) -> dict:
    """The folder's method in one dict {method, group, symmetric, v1}, or a one-line UsageError naming
    what is supported."""
    method = str(qc.get("quant_method", "")).lower()

    def refuse(what: str):
        raise UsageError(f"a pre-quantized folder ({what}) is not supported: supported are {SUPPORTED}; "
                         "or convert the float checkpoint, with --quantize int4")

    if method == "compressed-tensors":
        groups = qc.get("config_groups") or {}
        fmt = qc.get("format")
        if len(groups) != 1:
            refuse(f"compressed-tensors with {len(groups)} config groups")
        g = next(iter(groups.values()))
        w, fmt = g.get("weights") or {}, g.get("format") or fmt
        if fmt != "pack-quantized":
            refuse(f"compressed-tensors format {fmt}")
        if g.get("input_activations") or g.get("output_activations"):
            refuse("compressed-tensors with activation quantization")
        if w.get("num_bits") != 4 or w.get("type", "int") != "int":
            refuse(f"compressed-tensors {w.get('type')} {w.get('num_bits')}-bit weights")
        if w.get("strategy") != "group" or w.get("actorder") not in (None, False, "none"):
            refuse(f"compressed-tensors strategy {w.get('strategy')}, actorder {w.get('actorder')}")
        group, sym, v1 = w.get("group_size"), bool(w.get("symmetric", True)), False
    elif method in ("gptq", "awq"):
        bits = qc.get("bits", qc.get("w_bit"))
        group = qc.get("group_size", qc.get("q_group_size"))
        if bits != 4:
            refuse(f"{method} with bits {bits}")
        if method == "gptq":
            if qc.get("desc_act"):
                refuse("gptq with desc_act true (act-order)")
            fmt = str(qc.get("checkpoint_format") or "gptq").lower()
            if fmt not in ("gptq", "gptq_v2"):
                refuse(f"gptq checkpoint_format {fmt}")
            sym, v1 = bool(qc.get("sym", True)), fmt == "gptq"
        else:
            version = str(qc.get("version", "gemm")).lower()
            if version != "gemm" or not qc.get("zero_point", True):
                refuse(f"awq version {version}, zero_point {qc.get('zero_point')}")
            sym, v1 = False, False
    else:
        refuse(f"quant_method {method or 'missing'}")
    if group not in GROUPS:
        refuse(f"{method} group size {group}: MatMulNBits takes blocks of {', '.join(map(str, GROUPS))}")
    return {"method": method, "group": int(group), "symmetric": sym, "v1": v1}


class Source:
    """A pre-quantized folder: its packed Linears (read lazily from its safetensors) and the float folder
    of its dequantized weights (a temporary folder, removed on leaving)."""

    def __init__(self, folder: Path, info: dict):
        self.folder, self.info = folder, info
        self.method, self.group = info["method"], info["group"]
        self._files = _tensor_files(folder)
        marker = MARKER[self.method]
        self.linears = sorted(name[: -len(marker) - 1] for name in self._files if name.endswith("." + marker))
        if not self.linears:
            raise UsageError(f"'{folder}': its config says {self.method} but no '*.{marker}' tensor is in its "
                             "safetensors: a folder written by a GPTQ / AWQ / compressed-tensors library is expected")
        self.tmp = None
        self.args = None

    def _get(self, name: str):
        if name not in self._files:
            return None
        from safetensors import safe_open

        with safe_open(str(self._files[name]), framework="pt") as f:
            t = f.get_tensor(name)
        return t.float().numpy() if t.is_floating_point() else t.numpy()

    def unpack(self, prefix: str) -> Packed:
        p = self._unpack(prefix)
        blocks = (p.k + p.group - 1) // p.group
        if p.scale.shape != (p.n, blocks) or p.zero.shape != (p.n, blocks):
            raise ValueError(f"weight [{p.n}, {p.k}] with scales {list(p.scale.shape)} and zero points "
                             f"{list(p.zero.shape)}, not [{p.n}, {blocks}] for group {p.group}")
        return p

    def _unpack(self, prefix: str) -> Packed:
        g, p = self.group, prefix + "."
        if self.method == "gptq":
            return unpack_gptq(self._get(p + "qweight"), self._get(p + "qzeros"), self._get(p + "scales"),
                               self._get(p + "g_idx"), g, self.info["v1"])
        if self.method == "awq":
            return unpack_awq(self._get(p + "qweight"), self._get(p + "qzeros"), self._get(p + "scales"), g)
        return unpack_compressed(self._get(p + "weight_packed"), self._get(p + "weight_zero_point"),
                                 self._get(p + "weight_scale"), self._get(p + "weight_shape"), g)

    def _own(self, name: str) -> bool:
        return any(name.startswith(lin + ".") for lin in self._linear_set) and not name.endswith(".bias")

    def write_float(self, dest: Path) -> None:
        """The dequantized model as a float32 transformers folder at `dest`: each packed Linear's weight
        dequantized (Packed.dequantized), every other tensor as it is (floats as float32), config.json
        without quantization_config, the other files linked."""
        import torch
        from safetensors.torch import save_file

        self._linear_set = set(self.linears)
        tensors = {}
        for lin in self.linears:
            try:
                w = self.unpack(lin).dequantized()
            except UsageError:
                raise
            except Exception as e:  # noqa: BLE001 - a damaged packing: one line
                raise UsageError(f"'{self.folder}': {lin}'s {self.method} tensors do not unpack ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0][:120] if str(e) else ''}): the folder is damaged or not "
                                 f"written by a {self.method} library") from None
            tensors[lin + ".weight"] = torch.from_numpy(w)
        for name in self._files:
            if self._own(name):
                continue
            from safetensors import safe_open

            with safe_open(str(self._files[name]), framework="pt") as f:
                t = f.get_tensor(name)
            tensors[name] = t.float() if t.is_floating_point() else t
        dest.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(dest / "model.safetensors"),
                  metadata={"format": "pt"})
        cfg = json.loads((self.folder / "config.json").read_text())
        cfg.pop("quantization_config", None)
        for key in ("torch_dtype", "dtype"):
            if key in cfg:
                cfg[key] = "float32"
        (dest / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in self.folder.iterdir():
            if f.is_file() and f.name not in ("config.json", "quantization_config.json") and f.suffix != ".safetensors" \
                    and not f.name.endswith(".safetensors.index.json") and f.suffix not in (".bin", ".pt", ".pth"):
                (dest / f.name).symlink_to(f.resolve())

    def __enter__(self) -> "Source":
        return self

    def __exit__(self, *exc) -> None:
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None


def _tensor_files(folder: Path) -> dict:
    """tensor name -> the safetensors file holding it."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise UsageError(f"'{folder}' is pre-quantized but holds no *.safetensors file: the packed weights are read "
                         "from safetensors (save the quantized model with safe_serialization)")
    names = {}
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                names[k] = f
    return names


# -- convert ------------------------------------------------------------------------------------------------

_INT4_FLAGS = ("block_size", "asymmetric", "quant_algo")


def open_source(args) -> Source | None:
    """For `convert`: None where args.model is no pre-quantized folder; else, before anything is loaded
    or written, the refusals (one line, exit 2) and the Source with its float folder written to a temp
    folder, `source.args` the arguments convert runs with (the model: the float folder; --quantize int4
    with the folder's group size and symmetry)."""
    qc = quantization_config(getattr(args, "model", None) or "")
    if qc is None:
        return None
    folder = Path(args.model)
    info = describe(qc)
    quant = getattr(args, "quantize", None)
    if quant not in (None, "int4"):
        raise UsageError(f"'{folder}' is pre-quantized ({info['method']} int4): it goes to MatMulNBits with --target "
                         f"ort (--quantize int4 or nothing), not --quantize {quant}")
    if getattr(args, "target", "trt") not in ("ort", "onnx"):
        raise UsageError(f"'{folder}' is pre-quantized ({info['method']} int4): its packed weights go to MatMulNBits, "
                         f"an onnxruntime op: pass --target ort (not --target {args.target})")
    given = [f"--{f.replace('_', '-')}" for f in _INT4_FLAGS if getattr(args, f, None) not in (None, False)]
    block = getattr(args, "block_size", None)
    if given and not (given == ["--block-size"] and block == info["group"]):
        raise UsageError(f"{', '.join(given)}: '{folder}' is pre-quantized ({info['method']}, group {info['group']}, "
                         f"{'symmetric' if info['symmetric'] else 'asymmetric'}): its packing is kept as it is; "
                         "leave these flags out")
    if getattr(args, "dtype", None) not in (None, "float32"):
        raise UsageError(f"--dtype {args.dtype}: '{folder}' is pre-quantized: its MatMulNBits take float32 "
                         "activations here; leave --dtype out")
    if getattr(args, "module", None):
        raise UsageError(f"--module: '{folder}' is pre-quantized: it converts as a whole; leave --module out")
    source = dequantized(folder, info)
    new = argparse.Namespace(**vars(args))
    new.model, new.quantize, new.block_size = str(source.tmp / "float"), "int4", info["group"]
    new.asymmetric, new.quant_algo = not info["symmetric"], None
    new.prequantized_from = str(folder)
    source.args = new
    print(f"pre-quantized: '{folder}' is {info['method']} int4 (group {info['group']}, "
          f"{'symmetric' if info['symmetric'] else 'asymmetric'}): {len(source.linears)} packed Linear(s) go to "
          "MatMulNBits as they are; eager (export and verdict) runs on their dequantized weights")
    return source


def dequantized(folder: Path, info: dict | None = None) -> Source:
    """The Source of a pre-quantized folder with its float folder written (source.tmp / "float"; removed
    when the Source is left); unsupported: one line (UsageError)."""
    info = info or describe(quantization_config(folder))
    source = Source(Path(folder), info)
    source.tmp = Path(tempfile.mkdtemp(prefix="normexport-prequantized-"))
    try:
        source.write_float(source.tmp / "float")
    except BaseException:
        source.__exit__()
        raise
    return source


def options(source: Source, opts: dict) -> dict:
    """--quantize int4's options for the folder: its group and symmetry, the algorithm its method."""
    return {**opts, "block_size": source.group, "symmetric": source.info["symmetric"], "algorithm": source.method}


# -- the repacking ------------------------------------------------------------------------------------------


def _pack_rows(values: np.ndarray) -> np.ndarray:
    """uint8 [R, C] of 0..15 -> [R, ceil(C / 2)] bytes, even columns in the low nibble (MatMulNBits)."""
    r, c = values.shape
    if c % 2:
        values = np.concatenate([values, np.zeros((r, 1), dtype=np.uint8)], axis=1)
    return (values[:, 0::2] | (values[:, 1::2] << 4)).astype(np.uint8)


def matmulnbits_tensors(parts: list) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, int, int, int]:
    """Packed parts (consecutive output columns of one MatMul) -> (B [N, blocks, block/2] uint8, scales
    [N * blocks] float32, zero_points [N * ceil(blocks / 2)] uint8 or None where every zero point is 8,
    K, N, block): MatMulNBits' layout (onnxruntime contrib op: blocks of `block` along K, low nibble first)."""
    block, k = parts[0].group, parts[0].k
    q = np.concatenate([p.q for p in parts], axis=0)
    zero = np.concatenate([p.zero for p in parts], axis=0)
    scale = np.concatenate([p.scale for p in parts], axis=0)
    n, blocks = q.shape[0], (k + block - 1) // block
    if blocks * block != k:
        q = np.concatenate([q, np.zeros((n, blocks * block - k), dtype=np.uint8)], axis=1)
    b = _pack_rows(q).reshape(n, blocks, block // 2)
    zp = None if np.all(zero == 8) else _pack_rows(zero[:, :blocks]).reshape(-1)
    return b, scale[:, :blocks].astype(np.float32).reshape(-1), zp, k, n, block


def repack(model, source: Source, float_ir, opts: dict):
    """The float file's ModelProto `model` (int4._lazy: its weights left on disk; float_ir: the same
    file in onnx-ir, read lazily), edited in place: each MatMul whose constant
    weight is one or more of the folder's packed Linears (side by side: normexport.llm.packing
    concatenates q / k / v and gate / up) replaced by a MatMulNBits built from their packed tensors;
    a MatMul whose weight is no packed Linear's dequantization (the LM head a writer left in float)
    stays as it is. Returns (the ModelProto, how many MatMuls became MatMulNBits)."""
    from onnx import helper, numpy_helper

    index: dict = {}  # the bytes of a Linear's dequantized row 0 (its weight's column 0 in the file) -> the Linear
    for lin in source.linears:
        index.setdefault(source.unpack(lin).dequantized()[0].tobytes(), lin)
    inits = {t.name: t for t in model.graph.initializer}
    floats = float_ir.graph.initializers
    uses: dict = {}
    for node in model.graph.node:
        for i in node.input:
            uses[i] = uses.get(i, 0) + 1
    done, drop = 0, set()
    for node in list(model.graph.node):
        if node.op_type != "MatMul" or node.domain not in ("", "ai.onnx") or len(node.input) != 2:
            continue
        name = node.input[1]
        if name not in inits or name not in floats or floats[name].const_value is None:
            continue
        w = floats[name].const_value.numpy()
        if w.ndim != 2 or w.dtype != np.float32:
            continue
        parts, c = [], 0
        while c < w.shape[1]:
            lin = index.get(np.ascontiguousarray(w[:, c]).tobytes())
            if lin is None:
                break
            p = source.unpack(lin)
            if p.k != w.shape[0] or not np.array_equal(w[:, c:c + p.n], p.dequantized().T):
                break
            parts.append(p)
            c += p.n
        if c != w.shape[1] or not parts:
            continue
        b, scales, zp, k, n, block = matmulnbits_tensors(parts)
        new_inits = [numpy_helper.from_array(b, f"{name}_Q4"), numpy_helper.from_array(scales, f"{name}_scales")]
        inputs = [node.input[0], f"{name}_Q4", f"{name}_scales"]
        if zp is not None:
            new_inits.append(numpy_helper.from_array(zp, f"{name}_zero_points"))
            inputs.append(f"{name}_zero_points")
        attrs = {"K": k, "N": n, "bits": 4, "block_size": block}
        if opts.get("accuracy_level"):
            attrs["accuracy_level"] = opts["accuracy_level"]
        q = helper.make_node("MatMulNBits", inputs, list(node.output), name=f"{node.name}_Q4" if node.name else "",
                             domain="com.microsoft", **attrs)
        at = list(model.graph.node).index(node)
        model.graph.node.remove(node)
        model.graph.node.insert(at, q)
        model.graph.initializer.extend(new_inits)
        uses[name] -= 1
        if uses[name] == 0:
            drop.add(name)
        done += 1
    keep = [t for t in model.graph.initializer if t.name not in drop]
    del model.graph.initializer[:]
    model.graph.initializer.extend(keep)
    if done and not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return model, done
