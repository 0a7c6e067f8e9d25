"""A transformers model loaded as a pipeline component or a folder gives back no KV-cache object (issue 46,
found on QwenImagePipeline: its text encoder, Qwen2_5_VLForConditionalGeneration, reads `use_cache` from its
nested text_config, so turning off the top-level flag alone left a DynamicCache among the recorded outputs, and
the loaded pipeline stopped: 'the exported component returned a DynamicCache, which its file cannot give back')."""

import torch
import transformers

from normexport.load._util import without_cache
from normexport.load.call import describe


def _qwen25_vl():
    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=16, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=8, rope_theta=10000.0,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        vocab_size=16, hidden_size=16)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg).eval()


def _has_other(node) -> bool:
    if not isinstance(node, dict):
        return False
    return "other" in node or any(_has_other(v) for v in node.get("values", []) + node.get("items", []))


def test_nested_text_config_gives_no_cache():
    torch.manual_seed(0)
    model = _qwen25_vl()
    ids = torch.randint(0, 16, (2, 7))
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    assert before.past_key_values is not None  # the library's default: the case this guards
    without_cache(model.config)
    assert model.config.text_config.use_cache is False
    with torch.no_grad():
        after = model(input_ids=ids, attention_mask=torch.ones_like(ids), output_hidden_states=True)
    assert after.past_key_values is None and not _has_other(describe(after))
    # the values the pipeline reads are unchanged
    for a, b in zip(before.hidden_states, after.hidden_states):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
