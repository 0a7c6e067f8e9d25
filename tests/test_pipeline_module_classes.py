"""A component class defined beside its pipeline in diffusers (model_index.json names the pipeline
module as the library: StableAudioPipeline's `"projection_model": ["stable_audio",
"StableAudioProjectionModel"]`) is loaded from `diffusers.pipelines.<library>`, as diffusers' own
from_pretrained does. The swept StableAudioPipeline (tools/try_pipeline_families.py) converted, then
load() and check refused OUT: "names stable_audio.StableAudioProjectionModel, which normexport does not
load (only diffusers / transformers classes)". Anything else a manifest names is still refused.

Planted (seen failing once, then removed): _pipeline_module returning None.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from normexport.errors import UsageError
from normexport.pipeline.runtime import _library_class

diffusers = pytest.importorskip("diffusers")


def test_class_of_a_diffusers_pipeline_module_loads():
    where = Path("model_index.json")
    assert _library_class("stable_audio", "StableAudioProjectionModel", where) is diffusers.StableAudioProjectionModel
    assert _library_class("diffusers", "AutoencoderOobleck", where) is diffusers.AutoencoderOobleck


@pytest.mark.parametrize("library, name", [("os", "system"), ("stable_audio.x", "Y"), ("no_such_pipeline", "X"),
                                           ("stable_audio", "not an identifier")])
def test_other_libraries_are_refused(library, name):
    with pytest.raises(UsageError, match="which normexport does not load"):
        _library_class(library, name, Path("model_index.json"))


def test_pipeline_module_class_built_on_meta_with_its_config(tmp_path):
    """load() builds the component's class from its config on the meta device (its config and submodules
    for the pipeline): a diffusers class from a pipeline module is a ConfigMixin like any diffusers class
    (the swept StableAudioPipeline had failed: "'OrtComponent' object has no attribute 'config'")."""
    from normexport.pipeline.runtime import _meta_module

    diffusers.StableAudioProjectionModel(text_encoder_dim=16, conditioning_dim=4, min_value=0,
                                         max_value=32).save_config(tmp_path / "projection_model")
    meta = _meta_module(tmp_path, ["stable_audio", "StableAudioProjectionModel"],
                        {"forward": ("projection_model", {})})
    assert isinstance(meta, diffusers.StableAudioProjectionModel) and meta.config.conditioning_dim == 4
