"""normexport: PyTorch -> ONNX / TensorRT with normalization layers done right.

Python API (imported lazily):
    normexport.load(MODEL)                 -> LoadedModel   (normexport/load/)
    normexport.prepare(module)             -> module with normexport norm ops swapped in (normexport/prepare/)
    normexport.fold_batchnorm(module)      -> module with BatchNorm folded
    normexport.convert_module(module, args, target="trt") -> onnx.ModelProto
    normexport.rewrite(model_proto, target="trt")         -> onnx.ModelProto
    normexport.check(onnx_model, module, inputs)          -> CheckReport
    with normexport.capture(module, "inputs.pt"): ...      records module's first call for --inputs
"""

import importlib

__version__ = "0.1.0"

_API = {
    "load": ("normexport.load", None),  # callable packages
    "prepare": ("normexport.prepare", None),
    "fold_batchnorm": ("normexport.prepare", "fold_batchnorm"),
    "convert_module": ("normexport.export", "convert_module"),
    "rewrite": ("normexport.rewriter", "rewrite"),
    "check": ("normexport.parity", "check"),
    "capture": ("normexport.capture", None),  # callable module (normexport/capture.py)
}


def __getattr__(name):
    if name in _API:
        module, attr = _API[name]
        mod = importlib.import_module(module)
        return mod if attr is None else getattr(mod, attr)
    raise AttributeError(f"module 'normexport' has no attribute '{name}'")


__all__ = ["__version__", *_API]
