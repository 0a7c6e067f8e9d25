"""normexport: PyTorch -> ONNX / TensorRT with normalization layers done right."""

__version__ = "0.1.0"
