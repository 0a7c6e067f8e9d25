"""A denoiser folder alone (a diffusers transformer / unet `save_pretrained` folder with no
`model_index.json` beside it; docs/design.md §9, issue 46 item 7): where the inputs derived from
its forward and config are refused (or cannot be made), its call is recorded from a pipeline
class of diffusers that takes this class in its `transformer` / `unet` slot (the pipeline's
`__init__` annotation says which) — the pipeline knows how to make the denoiser's inputs
(prepare_latents, position ids and RoPE tables, text shapes).

The other components are tiny stand-ins of the classes the pipeline's `__init__` annotations
name, random weights: a word-level tokenizer for every tokenizer; each transformers text encoder
built from its config class with one layer and the text width `W`; a diffusers model (the VAE)
built with its defaults, uninitialised (it is only read for its config before the first step);
the scheduler with its defaults; optional components None. `W` is not known from the pipeline:
the widths the denoiser's config names for text (caption / joint / cross-attention / text-embed
fields) are tried in turn, and the first whose recorded call the denoiser's eager forward accepts
is kept. The pipeline is run as a pipeline folder is (`pipeline.call_arguments`: one step, 64x64,
output_type="latent") with `normexport.capture` on the denoiser, stopped at its first call.

Pipelines are tried text-to-X first (fewest image / video / control inputs), at most `TRIES`.
When none gives a call the denoiser accepts, the derived inputs' refusal stands with one more
clause: the pipeline class to run it in and the call to record (`--inputs`).
"""

from __future__ import annotations

import contextlib
import inspect
import shutil
import tempfile
import time
import typing
from pathlib import Path

import torch
from torch import nn

from ..capture import Capture, save
from ..errors import UsageError, first_line
from ._util import quiet

#: pipelines tried per denoiser class (each: one build and up to len(widths) one-step runs)
TRIES = 4
#: words of the stand-in tokenizer (the prompt `pipeline.PROMPT` is among them)
WORDS = "a photo of cat dog"
#: the stand-in text encoders' vocabulary (the tokenizer's ids and any special id a config names fit)
VOCAB = 64
#: a pipeline class name with one of these takes an image / video / control input beyond the prompt
CONDITIONED = ("Img2Img", "Image2Image", "ImageToVideo", "Image2Video", "I2V", "Inpaint", "Control", "Edit",
               "VideoToVideo", "Video2World", "Refiner", "Upscale", "Depth", "Adapter", "Prior", "Redux", "Fill",
               "Kontext", "PAG", "Framepack", "Condition", "Animate", "AudioToAudio", "Pyramid", "KV", "Mobile", "DFR",
               "Pix2Pix", "Interpolat", "Long", "Multi", "Plus", "SR")


class StandInError(Exception):
    """A component of the pipeline this module cannot stand in for."""


def pipelines_taking(cls: type) -> list[tuple[type, str]]:
    """(pipeline class, slot) for every diffusers pipeline whose `__init__` annotates its
    `transformer` / `unet` parameter with `cls` (alone or in a Union), text-to-X first. Only the
    pipeline modules whose source names the class are imported (importing all of them takes
    half a minute)."""
    import diffusers

    found = []
    for module in _pipeline_modules(cls.__name__):
        for name, pcls in vars(module).items():
            if not (isinstance(pcls, type) and name.endswith("Pipeline") and pcls.__module__ == module.__name__):
                continue
            try:
                params = inspect.signature(pcls.__init__).parameters
            except (TypeError, ValueError):
                continue
            for slot in ("transformer", "unet"):
                p = params.get(slot)
                if p is not None and cls in _classes(p.annotation) and getattr(diffusers, name, None) is pcls:
                    found.append((pcls, slot))
    return sorted(dict.fromkeys(found), key=lambda f: (sum(k in f[0].__name__ for k in CONDITIONED),
                                                       len(f[0].__name__), f[0].__name__))


def _pipeline_modules(class_name: str) -> list:
    """The modules of diffusers.pipelines whose source mentions `class_name`, imported."""
    import importlib

    import diffusers.pipelines as pipelines

    root = Path(pipelines.__file__).parent
    out = []
    for f in sorted(root.rglob("pipeline_*.py")):
        try:
            if class_name not in f.read_text(errors="ignore"):
                continue
        except OSError:
            continue
        name = "diffusers.pipelines." + ".".join(f.relative_to(root).with_suffix("").parts)
        try:
            with quiet():
                out.append(importlib.import_module(name))
        except Exception:  # noqa: BLE001 - a pipeline whose optional backend is missing
            continue
    return out


def _classes(annotation) -> list[type]:
    if isinstance(annotation, type):
        return [annotation]
    return [a for a in typing.get_args(annotation) if isinstance(a, type)]


def text_widths(module: nn.Module) -> list[int]:
    """Candidate text-encoder widths: the config's int fields that name text conditioning, in
    config order, then 32."""
    config = getattr(module, "config", None) or {}
    keys = ("caption", "joint_attention", "cross_attention", "text", "cap_feat", "txt", "context", "encoder_hid",
            "pooled_projection", "condition_dim", "prompt")
    out = []
    for k, v in dict(config).items():
        if isinstance(v, int) and not isinstance(v, bool) and v > 1 and any(s in k for s in keys) \
                and not any(s in k for s in ("len", "layers", "heads", "num_", "max_")):
            out.append(v)
        elif isinstance(v, (list, tuple)) and "cross_attention" in k and v and isinstance(v[0], int):
            out.append(v[0])
    return list(dict.fromkeys(out + [32]))


def tokenizer():
    """A word-level fast tokenizer (T5-like ids: pad 0, eos 1, unk 2)."""
    import tokenizers
    import transformers
    from tokenizers import models, pre_tokenizers

    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "<s>": 3}
    vocab.update({w: 4 + i for i, w in enumerate(WORDS.split())})
    tok = tokenizers.Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    out = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="</s>",
                                               unk_token="<unk>", bos_token="<s>", model_max_length=77)
    out.chat_template = CHAT  # pipelines that wrap the prompt in their text encoder's chat template
    return out


#: the stand-in tokenizer's chat template: each message's text (a string, or the text parts of a list)
CHAT = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}"
        "{% endif %} {% endfor %}")


def _shrink_config(config, width: int):
    """One layer, two heads, `width` wide, a VOCAB-token vocabulary; sub-configs (text / vision) alike."""
    from transformers import PretrainedConfig

    head = max(1, width // 2)
    sets = {("hidden_size", "d_model", "n_embd", "dim", "embed_dim", "projection_dim", "text_embed_dim"): width,
            ("intermediate_size", "d_ff", "ffn_dim", "n_inner", "encoder_ffn_dim"): 32,
            ("num_hidden_layers", "num_layers", "n_layer", "num_decoder_layers", "depth", "encoder_layers"): 1,
            ("num_attention_heads", "num_heads", "n_head", "num_key_value_heads", "encoder_attention_heads"): 2,
            ("head_dim", "d_kv"): head,
            ("vocab_size",): VOCAB}
    for names, value in sets.items():
        for n in names:
            if isinstance(getattr(config, n, None), int) and not isinstance(getattr(config, n), bool):
                setattr(config, n, value)
    for n in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        v = getattr(config, n, None)
        if isinstance(v, int) and v >= VOCAB:
            setattr(config, n, 1)
    for n in ("layer_types",):
        if isinstance(getattr(config, n, None), list):
            setattr(config, n, getattr(config, n)[:1])
    rope = getattr(config, "rope_scaling", None) or getattr(config, "rope_parameters", None)
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list):  # sums to head_dim / 2
        sec = rope["mrope_section"]
        half = head // 2
        new = [max(1, round(s * half / max(1, sum(sec)))) for s in sec]
        new[-1] = half - sum(new[:-1])
        rope["mrope_section"] = new
    for k, v in list(vars(config).items()):
        if isinstance(v, PretrainedConfig):
            _shrink_config(v, width if "text" in k else 16)
    return config


def text_encoder(cls: type, width: int):
    """cls (a transformers model) with one layer, `width` wide, random weights."""
    config_cls = getattr(cls, "config_class", None)
    if config_cls is None:
        raise StandInError(f"{cls.__name__} names no config class")
    config = _shrink_config(config_cls(), width)
    torch.manual_seed(0)
    return cls(config).eval()


def _uninitialised(cls: type):
    """A diffusers model of its default config, memory taken but not initialised (read for its
    config and buffers' shapes only: the run stops at the denoiser's first call)."""
    kwargs = {}
    blocks = inspect.signature(cls.__init__).parameters.get("block_out_channels")
    if blocks is not None and isinstance(blocks.default, (tuple, list)) and 0 < len(blocks.default) < 4:
        # AutoencoderKL's default is one block (scale factor 1): four, the 8x of the VAEs diffusers ships
        kwargs["block_out_channels"] = (blocks.default[0],) * 4
    with torch.device("meta"):
        try:
            m = cls(**kwargs)
        except Exception:  # noqa: BLE001 - a class whose other defaults want its own block count
            m = cls()
    return m.to_empty(device="cpu").eval()


def components(pipeline_cls: type, slot: str, denoiser: nn.Module, width: int) -> dict:
    """The pipeline's `__init__` arguments: the denoiser in its slot, stand-ins for the rest."""
    import diffusers
    import transformers

    params = inspect.signature(pipeline_cls.__init__).parameters
    optional = set(getattr(pipeline_cls, "_optional_components", None) or [])
    out = {slot: denoiser}
    for name, p in params.items():
        if name in ("self", slot) or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is not p.empty:  # an optional component None, a flag at its default
            if p.default is None:
                out[name] = None
            elif p.default is True and any(k in name for k in ("safety", "watermark")):
                out[name] = False  # a safety checker / watermarker is no part of the denoiser's call
            continue
        classes = _classes(p.annotation)
        made = None
        for c in classes:
            try:
                made = _one(name, c, width, diffusers, transformers)
            except StandInError as e:
                made = e
                if name not in optional:
                    raise
                continue
            except Exception as e:  # noqa: BLE001 - the next class of the Union
                made = StandInError(f"{name} ({c.__name__}): {first_line(e, 120)}")
                continue
            break
        if made is None and "scheduler" in name:  # annotated with an enum of scheduler names (UNet pipelines)
            made = diffusers.DDIMScheduler()
        if (made is None or isinstance(made, StandInError)) and name in optional:
            out[name] = None
            continue
        if made is None or isinstance(made, StandInError):
            raise made if isinstance(made, StandInError) else StandInError(
                f"{name} ({p.annotation}): no stand-in for that annotation")
        out[name] = made
    return out


def _one(name: str, c: type, width: int, diffusers, transformers):
    if issubclass(c, diffusers.SchedulerMixin):
        return c()
    if issubclass(c, transformers.PreTrainedTokenizerBase) or (c.__name__ == "AutoTokenizer"):
        return tokenizer()
    if c is transformers.PreTrainedModel or c.__name__.startswith("AutoModel"):
        # annotated with the base / auto class: any model giving hidden states stands in (T5's encoder)
        return text_encoder(transformers.T5EncoderModel, width)
    if issubclass(c, transformers.PreTrainedModel):
        return text_encoder(c, width)
    if issubclass(c, diffusers.ModelMixin):
        return _uninitialised(c)
    if issubclass(c, (transformers.ProcessorMixin,)):
        raise StandInError(f"{name} is a {c.__name__} (a multimodal processor)")
    if issubclass(c, (transformers.ImageProcessingMixin, transformers.FeatureExtractionMixin)):
        return c()
    return None


def _record_one(pipe, slot: str, denoiser: nn.Module, file: Path) -> tuple[tuple, dict, str]:
    """The denoiser's first call in a one-step run of `pipe` (pipeline.call_arguments), then its
    eager forward on that call; (args, kwargs, size)."""
    from .pipeline import call_arguments, registered

    modules = {n: c for n, c in registered(pipe).items() if isinstance(c, nn.Module)}
    kwargs, size = call_arguments(pipe, modules, file.parent, slot)
    with quiet():
        with Capture(denoiser, file, stop=True, quiet=True) as cap:
            pipe(**kwargs)
    if cap.args is None:
        raise StandInError("the one-step run ended without calling it")
    call_kwargs = {k: v for k, v in cap.kwargs.items() if not (k == "return_dict" and v is False)}
    with torch.no_grad(), quiet():
        denoiser(*cap.args, **call_kwargs)  # the call the pipeline made, accepted by its forward
    return cap.args, call_kwargs, size


def record(denoiser: nn.Module, file: Path) -> tuple[str, list[str]]:
    """The denoiser's call recorded to `file` from the first pipeline class that makes one its
    forward accepts; (how it was made, the reasons the pipelines tried failed). Raises
    StandInError (with the reasons) when none did."""
    cls = type(denoiser)
    pipelines = pipelines_taking(cls)
    if not pipelines:
        raise StandInError(f"no pipeline class of this diffusers takes {cls.__name__}")
    reasons: list[str] = []
    start = time.perf_counter()
    for pcls, slot in pipelines[:TRIES]:
        why = None
        for width in text_widths(denoiser):
            try:
                with quiet():
                    pipe = pcls(**components(pcls, slot, denoiser, width))
                if hasattr(pipe, "set_progress_bar_config"):
                    pipe.set_progress_bar_config(disable=True)
                args, kwargs, size = _record_one(pipe, slot, denoiser, file)
            except StandInError as e:
                why = str(e)
                break  # a component this module cannot make: the next pipeline
            except Exception as e:  # noqa: BLE001 - the run or the denoiser refused: the next width
                why = f"text width {width}: {type(e).__name__}: {first_line(e, 120)}"
                continue
            finally:
                pipe = None
            save(args, kwargs, file)
            seconds = time.perf_counter() - start
            return (f"recorded from one {pcls.__name__} step (1 step, {size}) with tiny stand-ins for its other "
                    f"components (text width {width}; built and run in {seconds:.1f} s)"), reasons
        reasons.append(f"{pcls.__name__}: {why}")
    raise StandInError("; ".join(reasons))


def hint(cls: type) -> str:
    """The line naming the pipeline class to record the call in."""
    pipelines = pipelines_taking(cls)
    if not pipelines:
        return ""
    pcls, slot = pipelines[0]
    return (f"; or record its call in {pcls.__name__} (a pipeline of diffusers that takes {cls.__name__} as its "
            f"{slot}): `with normexport.capture(pipe.{slot}, \"inputs.pt\", stop=True): pipe(prompt, "
            f"num_inference_steps=1)`, then --inputs inputs.pt")


@contextlib.contextmanager
def driven(loaded, refusal: str):
    """(the denoiser's LoadedModel, --inputs file) recorded by driving a pipeline class; the
    refusal of the derived inputs, with the pipeline line, when no pipeline drove it."""
    from .pipeline import _component_model

    module = loaded.module.inner
    tmp = tempfile.mkdtemp(prefix="normexport-standin-")
    file = Path(tmp) / "inputs.pt"
    try:
        try:
            source, _ = record(module, file)
        except StandInError as e:
            raise UsageError(f"{refusal}{hint(type(module))} (normexport drove it with tiny stand-ins: "
                             f"{str(e)[:300]})") from None
        out = _component_model(module, file, source, f"inputs: {source}")
        yield out, str(file)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
