"""Try `normexport convert` on encoder / vision / audio / time-series / seq2seq base-model folders no test names (tiny configs of the
real transformers classes, random weights, norm weights moved off 1, save_pretrained, defaults otherwise).
One line per family: exit code, seconds, the export line and the verdict.

    python tools/try_encoder_families.py [FAMILY ...]    # folders and files in /tmp/enc

Run 2026-11-29 on the 2-vCPU VM: benchmarks/results/encoder_families_2026-11-29_vm.txt (10 of 10 PASSED);
2026-11-30 with 34 more (CNNs, audio, time series, seq2seq, SSM): encoder_families_2026-11-30_vm.txt."""

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
 # 2026-11-30: CNNs (BatchNorm folded), audio, time series, seq2seq, SSM
 "regnet": (t.RegNetModel, t.RegNetConfig, dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=8)),
 "mobilenet_v1": (t.MobileNetV1Model, t.MobileNetV1Config, dict(image_size=32, depth_multiplier=0.25)),
 "mobilenet_v2": (t.MobileNetV2Model, t.MobileNetV2Config, dict(image_size=32, depth_multiplier=0.25)),
 "efficientnet": (t.EfficientNetModel, t.EfficientNetConfig, dict(image_size=32, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320)),
 "levit": (t.LevitModel, t.LevitConfig, dict(image_size=64, hidden_sizes=[16, 24, 32], num_attention_heads=[1, 2, 2], depths=[1, 1, 1], key_dim=[8, 8, 8], patch_size=16)),
 "convnextv2": (t.ConvNextV2Model, t.ConvNextV2Config, dict(image_size=32, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)),
 "swin": (t.SwinModel, t.SwinConfig, dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4)),
 "poolformer": (t.PoolFormerModel, t.PoolFormerConfig, dict(hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1])),
 "pvt_v2": (t.PvtV2Model, t.PvtV2Config, dict(image_size=32, hidden_sizes=[8, 16, 24, 32], depths=[1, 1, 1, 1], num_attention_heads=[1, 1, 2, 2])),
 "focalnet": (t.FocalNetModel, t.FocalNetConfig, dict(image_size=32, embed_dim=16, depths=[1, 1], patch_size=4)),
 "convbert": (t.ConvBertModel, t.ConvBertConfig, dict(common, embedding_size=32)),
 "squeezebert": (t.SqueezeBertModel, t.SqueezeBertConfig, dict(common, embedding_size=32)),
 "funnel": (t.FunnelModel, t.FunnelConfig, dict(vocab_size=96, block_sizes=[1, 1], d_model=32, n_head=4, d_head=8, d_inner=64)),
 "data2vec_vision": (t.Data2VecVisionModel, t.Data2VecVisionConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8)),
 "siglip": (t.SiglipModel, t.SiglipConfig, dict(text_config=dict(vocab_size=96, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, max_position_embeddings=16), vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8))),
 "hiera": (t.HieraModel, t.HieraConfig, dict(embed_dim=16, image_size=[64, 64], patch_size=[7, 7], patch_stride=[4, 4], patch_padding=[3, 3], depths=[1, 1, 1, 1], num_heads=[1, 1, 2, 2], masked_unit_size=[8, 8], query_stride=[2, 2], num_query_pool=2)),
 "textnet": (t.TextNetModel, t.TextNetConfig, dict()),
 "swiftformer": (t.SwiftFormerModel, t.SwiftFormerConfig, dict(image_size=32, depths=[1, 1, 1, 1], embed_dims=[8, 16, 24, 32])),
 "bit": (t.BitModel, t.BitConfig, dict(embedding_size=32, hidden_sizes=[32, 64], depths=[1, 1], num_groups=8)),
 "wav2vec2_conformer": (t.Wav2Vec2ConformerModel, t.Wav2Vec2ConformerConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, conv_depthwise_kernel_size=7)),
 "sew": (t.SEWModel, t.SEWConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16,)*3, conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, squeeze_factor=2)),
 "wavlm": (t.WavLMModel, t.WavLMConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2)),
 "encodec": (t.EncodecModel, t.EncodecConfig, dict(hidden_size=16, num_filters=4, upsampling_ratios=[4, 2], codebook_size=16, num_lstm_layers=1)),
 "speech2text": (t.Speech2TextModel, t.Speech2TextConfig, dict(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=64, max_target_positions=64, input_feat_per_channel=16, conv_channels=16)),
 "marian": (t.MarianModel, t.MarianConfig, dict(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=95, decoder_start_token_id=95)),
 "mbart": (t.MBartModel, t.MBartConfig, dict(vocab_size=96, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64)),
 "longt5": (t.LongT5Model, t.LongT5Config, dict(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4, local_radius=4, global_block_size=4)),
 "patchtst": (t.PatchTSTModel, t.PatchTSTConfig, dict(num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=16, num_attention_heads=2, num_hidden_layers=1, ffn_dim=32, norm_type="batchnorm")),
 "patchtsmixer": (t.PatchTSMixerModel, t.PatchTSMixerConfig, dict(num_input_channels=3, context_length=32, patch_length=8, patch_stride=8, d_model=16, num_layers=2, norm_mlp="BatchNorm")),
 "mamba": (t.MambaModel, t.MambaConfig, dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, state_size=8, expand=2)),
 "rwkv": (t.RwkvModel, t.RwkvConfig, dict(vocab_size=96, hidden_size=32, num_hidden_layers=2, attention_hidden_size=32, intermediate_size=64, context_length=64)),
 "layoutlmv3": (t.LayoutLMv3Model, t.LayoutLMv3Config, dict(common, input_size=32, patch_size=8, coordinate_size=4, shape_size=8)),
 "aimv2_vision": (t.Aimv2VisionModel, t.Aimv2VisionConfig, dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32, patch_size=8)),
 "dac": (t.DacModel, t.DacConfig, dict(encoder_hidden_size=8, downsampling_ratios=[2, 4], decoder_hidden_size=16, n_codebooks=2, codebook_size=16, codebook_dim=4, hidden_size=32)),
}
for name in (sys.argv[1:] or fams):
    cls, cfgc, kw = fams[name]
    try:
        torch.manual_seed(0)
        m = cls(cfgc(**kw)).eval()
        with torch.no_grad():
            for n, p in m.named_parameters():
                if ("norm" in n.lower() or "LayerNorm" in n or "bn" in n.lower()) and p.dim() == 1:
                    p.add_(0.2 * torch.randn_like(p))
            for n, b in m.named_buffers():  # non-default BatchNorm statistics
                if n.endswith("running_mean"):
                    b.copy_(0.3 * torch.randn_like(b))
                if n.endswith("running_var"):
                    b.copy_(0.5 + torch.rand_like(b))
        m.save_pretrained(W / name)
    except Exception as e:
        print(f"{name}: SETUP FAILED {type(e).__name__}: {str(e)[:150]}", flush=True); continue
    t0 = time.time()
    p = subprocess.run([sys.executable, "-m", "normexport", "convert", str(W / name), "-o", str(W / f"{name}.onnx")], capture_output=True, text=True, cwd=W)
    lines = (p.stdout + p.stderr).splitlines()
    ex = next((l for l in lines if l.startswith("exported ")), "")
    ver = next((l for l in reversed(lines) if l.startswith(("PASSED", "FAILED", "normexport: "))), "")
    print(f"{name}: exit {p.returncode}, {time.time()-t0:.0f} s | {ex[ex.find(':')+1:][:110]} | {ver[:300]}", flush=True)
