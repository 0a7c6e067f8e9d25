"""normexport.pipeline: a diffusers pipeline folder in, a folder of ONNX components out that loads
back as the same pipeline (docs/convert.md, "A pipeline folder out").

    recording  the pipeline run to its end, each component's call recorded (and the dims that vary)
    exporting  each component through the convert stages, the optimum layout, the manifest
    manifest   normexport_pipeline.json: what each file is and how the pipeline calls it
    runtime    load(OUT): the pipeline with onnxruntime sessions (or TensorRT engines) behind its components' calls
    compare    `check OUT --reference PIPELINE_DIR`: end to end against eager and float64
    engines    `build OUT/`: one TensorRT engine per component
    cli        the commands' routing (a pipeline folder, or the single-model commands)
"""

from __future__ import annotations


def load(folder, providers: list[str] | None = None, backend: str | None = None, plugin=None):
    """The diffusers pipeline of an exported folder, its neural components in onnxruntime or, with
    backend="trt" (or left out, for a folder whose engines `normexport build OUT/` made, where
    TensorRT runs them), TensorRT (runtime.load)."""
    from .runtime import load as _load

    return _load(folder, providers, backend=backend, plugin=plugin)


__all__ = ["load"]
