"""normexport.llm: causal LMs exported with their KV cache (DESIGN §10).

`cache` (CacheLM: the model with flat cache tensors in and out; names; the cache layout read from
the model) and `task` (`--task` of `convert`: which graph a causal-LM folder exports). The check
by generation lives in `normexport.parity.generate`; TensorRT profiles over past length in
`normexport.trt.profiles`.
"""

from __future__ import annotations

from .cache import CacheLM, CacheLayout, NoKVCache, name_dims, past_names, present_names, probe_layout
from .task import PLAIN, TASKS, WITH_PAST, causal_lm, resolve

__all__ = ["CacheLM", "CacheLayout", "NoKVCache", "name_dims", "past_names", "present_names", "probe_layout", "PLAIN", "TASKS",
           "WITH_PAST", "causal_lm", "resolve"]
