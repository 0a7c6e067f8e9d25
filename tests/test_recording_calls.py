"""The dims a pipeline folder's files keep dynamic are those that differ between any two recorded
calls of a component — within one run too. SanaPipeline calls its Gemma2 text encoder with the
prompt behind its complex-human instruction (494 tokens) and then the negative prompt (300): only
the first call of each run had been recorded, the sequence axis was fixed at 494 and the loaded
pipeline refused a one-prompt call ("input_ids [1, 300] (the file takes [2, 494])").
tools/try_pipeline_families.py sana: converts, generates. Planted (only a run's first call
recorded): the test fails."""

from __future__ import annotations

import torch

from normexport.pipeline.recording import _Run, call_shapes


class Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4)

    def forward(self, input_ids, attention_mask=None):
        return self.emb(input_ids)


class TwoCalls:
    """A pipeline's shape: the prompt, then the negative prompt of another length."""

    def __init__(self, enc):
        self.enc = enc

    def __call__(self, batch, lengths):
        for n in lengths:
            ids = torch.ones(batch, n, dtype=torch.long)
            self.enc(ids, attention_mask=torch.ones_like(ids))


def test_every_call_of_a_run_is_recorded():
    enc = Encoder()
    pipe = TwoCalls(enc)
    runs = []
    for batch, lengths, saved in ((2, (12, 7), True), (1, (12, 7), True), (1, (12, 7), False)):
        run = _Run({"text_encoder": enc})
        with run.hooks(pipe, first=saved):
            pipe(batch, lengths)
        runs.append(run)
    slot = runs[0].slots["text_encoder"]
    slot.shapes = call_shapes(runs, "text_encoder")
    assert slot.shapes[:2] == [{"input_ids": [2, 12], "attention_mask": [2, 12]},
                               {"input_ids": [2, 7], "attention_mask": [2, 7]}]
    assert slot.dynamic() == {"input_ids": [0, 1], "attention_mask": [0, 1]}
    assert list(slot.args[0].shape) == [2, 12]  # the file is exported from the first call


def test_dims_at_the_converted_size_leave_out_the_larger_run():
    """`dynamic(at_size=True)`: the axes that vary between the calls at the converted image size
    (batch, text length), not those that change only in the one-size-up run (the latent's size):
    the middle rung of a pipeline file whose full set of varying dims no exporter keeps (Latte's
    transformer: text length dynamic, latent size fixed)."""
    enc = Encoder()
    pipe = TwoCalls(enc)
    runs = []
    for batch, lengths, saved in ((2, (12,), True), (1, (12,), True), (1, (14,), False)):
        run = _Run({"text_encoder": enc})
        with run.hooks(pipe, first=saved):
            pipe(batch, lengths)
        runs.append(run)
    slot = runs[0].slots["text_encoder"]
    slot.shapes, slot.at_size = call_shapes(runs, "text_encoder"), len(call_shapes(runs[:2], "text_encoder"))
    assert slot.dynamic() == {"input_ids": [0, 1], "attention_mask": [0, 1]}
    assert slot.dynamic(at_size=True) == {"input_ids": [0], "attention_mask": [0]}
