"""The exporter ladder's rungs (docs/design.md §9), named once: their order and what each is called
(exporter/ladder.py reads it, and so does convert/summary.py without importing torch)."""

from __future__ import annotations

#: rung -> (what an export error calls it, what the export summary's first line calls it; `{axes}`: the
#: axes made static), in the ladder's order
RUNGS = {
    "dynamic": ("dynamo exporter", "dynamo exporter"),
    "static axes": ("dynamo exporter with the axes it cannot keep static", "dynamo exporter, static axes {axes}"),
    # the caller's narrower sets of axes, in its order (a pipeline component: the sizes that vary at this
    # image size, then the batch alone), each tried before every axis is made static
    "fewer axes": ("dynamo exporter with fewer dynamic axes", "dynamo exporter, static axes {axes}"),
    "static": ("dynamo exporter with static shapes", "dynamo exporter, static shapes"),
    "torchscript": ("TorchScript exporter", "torchscript exporter"),
    "torchscript static": ("TorchScript exporter with static shapes", "torchscript exporter, static shapes"),
}

#: the rungs, in order: the first file that exports (and that the judge accepts) is kept
LADDER = tuple(RUNGS)
#: rung -> its name in export errors
RUNG_TEXT = {rung: error for rung, (error, _) in RUNGS.items()}
#: rung -> its name on the export summary's first line (str.format with axes=...)
RUNG_SUMMARY = {rung: summary for rung, (_, summary) in RUNGS.items()}
