"""normexport.llm: causal LMs exported with their KV cache (docs/design.md §10).

`cache` (FlatCacheLM, the file's interface with flat cache tensors in and out, and CacheLM, a
transformers model through it; names; the cache layout read from the model), `program`
(ProgramLM: a .pt2 program that takes a KV cache through the same interface), `task`
(`--task` of `convert`: which graph a causal LM or .pt2 exports) and `deploy` (the deployable
folder: genai_config.json, tokenizer and config files beside the file), `attention` (the
GroupQueryAttention fusion for --target ort; its rule, rotary, mask, local-check and share-buffer
pieces in `gqa_rule`, `rotary`, `masks`, `verify`, `share_buffer`) and `checking` (`normexport
check` of a KV-cache file). The check by generation lives in `normexport.parity.generate`, a
layer below this one (normexport.parity imports nothing of normexport.llm); TensorRT profiles
over past length in `normexport.trt.profiles`.
"""

from __future__ import annotations

from .cache import CacheLM, CacheLayout, FlatCacheLM, NoKVCache, name_dims, past_names, present_names, probe_layout
from .program import ProgramLM
from .task import PLAIN, TASKS, WITH_PAST, causal_lm, resolve

__all__ = ["CacheLM", "CacheLayout", "FlatCacheLM", "NoKVCache", "ProgramLM", "name_dims", "past_names", "present_names", "probe_layout", "PLAIN", "TASKS",
           "WITH_PAST", "causal_lm", "resolve"]
