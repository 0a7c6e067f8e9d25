"""Small helpers shared by the load modules (imports nothing else from normexport.load)."""

from __future__ import annotations

import contextlib
import logging
import warnings

from ..errors import first_line


def meta_tensors(modules: dict) -> list[str]:
    """'name.parameter' of every parameter / buffer left on the meta device (no values) in the
    torch modules among `modules` ({name: component}): what a lazy or incomplete from_pretrained
    can leave, and what no run or float64 copy can use ("Cannot copy out of meta tensor")."""
    import itertools

    import torch

    out = []
    for name, m in modules.items():
        if isinstance(m, torch.nn.Module):
            out += [f"{name}.{k}" if name else k for k, t in itertools.chain(m.named_parameters(), m.named_buffers())
                    if t is not None and t.is_meta]
    return out


def refuse_meta_tensors(modules: dict, what: str, fix: str) -> None:
    """A one-line UsageError naming the tensors meta_tensors finds (the first 4, and how many)."""
    meta = meta_tensors(modules)
    if meta:
        more = f" and {len(meta) - 4} more" if len(meta) > 4 else ""
        from ..errors import UsageError

        raise UsageError(f"{what}: {len(meta)} weight(s) left on the meta device by from_pretrained, with no values "
                         f"({', '.join(meta[:4])}{more}): {fix}")


def without_cache(config) -> None:
    """`use_cache = False` on a transformers config and every config nested in it (`sub_configs`:
    Qwen2.5-VL's text_config reads its own flag, not the top-level one): a KV-cache object among a
    model's outputs is nothing a file can give back, and a text encoder's call never reads it (the
    cache of a generating model is --task's business). The computed values do not change."""
    stack, seen = [config], set()
    while stack:
        c = stack.pop()
        if c is None or id(c) in seen:
            continue
        seen.add(id(c))
        if hasattr(c, "use_cache"):
            c.use_cache = False
        stack += [getattr(c, name, None) for name in (getattr(c, "sub_configs", None) or {})]


def short(e: BaseException) -> str:
    return first_line(e, 160)


@contextlib.contextmanager
def quiet():
    """torch.export.load / from_pretrained log whole tracebacks (logger.warning(exc_info=True)) and
    warn about legacy formats: the user gets our one-line error instead."""
    previous = logging.root.manager.disable
    logging.disable(logging.CRITICAL)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)
