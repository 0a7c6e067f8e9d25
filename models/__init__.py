"""Reference models for normexport tests and benchmarks.

Every module here has a factory `tiny()` (CLI: `normexport.models.dit:tiny`) returning an eval-mode
nn.Module with seeded random, non-trivial weights, plus `example_inputs(batch, seq)`,
`input_names`, `output_names` and `dynamic_axes`.
"""

from __future__ import annotations

from ._common import randn, randomize_  # noqa: F401

FACTORIES = ("dit", "llama", "bert", "conv_bn", "norm_heavy")
