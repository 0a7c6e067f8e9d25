"""The tensors a pipeline reads from a component outside the exported call (docs/design.md §12).

The loaded pipeline's components stand on their class built on the meta device (runtime.OrtComponent:
config and submodules, no weights). Some pipelines read a component's own tensor values: LTXPipeline
denormalises the latents with `self.vae.latents_mean` / `latents_std` (AutoencoderKLLTXVideo's
buffers) before decoding; on the meta device that was "Cannot copy out of meta tensor; no data!"
deep in the run; Flux2KleinPipeline reads its VAE's batch-norm statistics through a submodule
(`self.vae.bn.running_mean`) to normalise and denormalise latents. Convert writes the component's
buffers, its submodules' included (by their dotted names, each up to BUFFER_LIMIT bytes, TOTAL_LIMIT
in all), beside its file, and load puts them into the meta module; any other tensor the pipeline
reads from the loaded component itself is refused in one line naming it
(runtime.OrtComponent.__getattr__), never handed over without values."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..errors import UsageError, first_line

FILE = "buffers.safetensors"
#: a buffer larger than this is not written (the pipelines read small statistics), nor any past TOTAL_LIMIT
BUFFER_LIMIT = 1 << 20
TOTAL_LIMIT = 16 << 20


def write(module: nn.Module, folder: Path) -> list[str]:
    """`module`'s buffers with values, its submodules' by their dotted names (`bn.running_mean`), each up
    to BUFFER_LIMIT bytes and TOTAL_LIMIT in all (its own first), in folder/FILE; their names (none: no file)."""
    tensors, total = {}, 0
    for n, b in sorted(module.named_buffers(), key=lambda nb: nb[0].count(".")):
        size = b.numel() * b.element_size() if b is not None else 0
        if b is not None and not b.is_meta and size <= BUFFER_LIMIT and total + size <= TOTAL_LIMIT:
            tensors[n] = b.detach().cpu().contiguous()
            total += size
    if tensors:
        from safetensors.torch import save_file

        save_file(tensors, str(Path(folder) / FILE))
    return sorted(tensors)


def load_into(meta: nn.Module, folder: Path) -> list[str]:
    """The buffers of folder/FILE put into `meta` (the component's class on the meta device) where it
    registers a buffer of that name; their names. A file that cannot be read is a one-line error."""
    path = Path(folder) / FILE
    if not path.is_file():
        return []
    try:
        from safetensors.torch import load_file

        tensors = load_file(str(path))
    except Exception as e:  # noqa: BLE001 - a damaged file (docs/design.md §14)
        raise UsageError(f"'{path}' cannot be read ({type(e).__name__}: {first_line(e, 160)}): convert the pipeline "
                         "folder again") from None
    put = []
    for name, t in tensors.items():
        path, _, leaf = name.rpartition(".")
        try:
            owner = meta.get_submodule(path) if path else meta
        except AttributeError:  # a name the class does not have: not put anywhere
            continue
        if leaf in owner._buffers:
            owner._buffers[leaf] = t
            put.append(name)
    return sorted(put)


def refuse_meta(component: str, name: str, value):
    """`value` unless it is a tensor on the meta device (no values): then a one-line UsageError."""
    if isinstance(value, torch.Tensor) and value.is_meta:
        raise UsageError(f"the pipeline reads {component}.{name} ({'x'.join(map(str, value.shape)) or 'scalar'} "
                         f"{str(value.dtype).replace('torch.', '')}) from the exported component, which holds no "
                         f"values for it (only the component's own buffers up to {BUFFER_LIMIT >> 20} MiB are "
                         f"written beside its file, {FILE}): convert the pipeline folder again with this normexport, "
                         "or run that component in torch")
    return value
