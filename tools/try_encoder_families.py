"""Try `normexport convert` on encoder / vision / seq2seq base-model folders no test names (tiny configs of the
real transformers classes, random weights, norm weights moved off 1, save_pretrained, defaults otherwise).
One line per family: exit code, seconds, the export line and the verdict.

    python tools/try_encoder_families.py [FAMILY ...]    # folders and files in /tmp/enc

Run 2026-11-29 on the 2-vCPU VM: benchmarks/results/encoder_families_2026-11-29_vm.txt (10 of 10 PASSED)."""

import subprocess, sys, time, torch, transformers as t
from pathlib import Path
W = Path("/tmp/enc")
W.mkdir(parents=True, exist_ok=True)
common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
fams = {
 "modernbert": (t.ModernBertModel, t.ModernBertConfig, dict(common, global_attn_every_n_layers=2, local_attention=8, pad_token_id=0)),
 "deberta_v2": (t.DebertaV2Model, t.DebertaV2Config, dict(common)),
 "electra": (t.ElectraModel, t.ElectraConfig, dict(common, embedding_size=16)),
 "albert": (t.AlbertModel, t.AlbertConfig, dict(common, embedding_size=16)),
 "mpnet": (t.MPNetModel, t.MPNetConfig, dict(common)),
 "distilbert": (t.DistilBertModel, t.DistilBertConfig, dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=64)),
 "xlm_roberta": (t.XLMRobertaModel, t.XLMRobertaConfig, dict(common)),
 "beit": (t.BeitModel, t.BeitConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8)),
 "mobilevit": (t.MobileViTModel, t.MobileViTConfig, dict(image_size=32, hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32])),
 "pegasus": (t.PegasusModel, t.PegasusConfig, dict(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
}
for name in (sys.argv[1:] or fams):
    cls, cfgc, kw = fams[name]
    try:
        torch.manual_seed(0)
        m = cls(cfgc(**kw)).eval()
        with torch.no_grad():
            for n, p in m.named_parameters():
                if ("norm" in n.lower() or "LayerNorm" in n) and p.dim() == 1:
                    p.add_(0.2 * torch.randn_like(p))
        m.save_pretrained(W / name)
    except Exception as e:
        print(f"{name}: SETUP FAILED {type(e).__name__}: {str(e)[:150]}", flush=True); continue
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "normexport", "convert", str(W / name), "-o", str(W / f"{name}.onnx")], capture_output=True, text=True, cwd=W)
    lines = (p.stdout + p.stderr).splitlines()
    ex = next((l for l in lines if l.startswith("exported ")), "")
    ver = next((l for l in reversed(lines) if l.startswith(("PASSED", "FAILED", "normexport: "))), "")
    print(f"{name}: exit {p.returncode}, {time.time()-t0:.0f} s | {ex[ex.find(':')+1:][:110]} | {ver[:300]}", flush=True)
