"""The model without its large initializers, for onnx's C++ passes (shape inference, version
converter): each round-trips the whole proto through C++ several times, which with the weights
in made rewriting a 480 MB model peak at 7x its size in memory."""

from __future__ import annotations

import onnx

#: initializers larger than this stay out of the model while onnx's C++ passes run
LIGHT_BYTES = 1024


def weightless(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[onnx.TensorProto], set[str]]:
    """(a copy of `model` whose large initializers are graph inputs of the same type and shape,
    those initializers, the names of the inputs added for them)."""
    g = model.graph
    big = [t for t in g.initializer if t.data_location == onnx.TensorProto.EXTERNAL or t.ByteSize() > LIGHT_BYTES]
    names = {t.name for t in big}
    light = onnx.ModelProto()
    for fd, value in model.ListFields():
        if fd.name != "graph":
            _copy_field(light, fd, value)
    for fd, value in g.ListFields():
        if fd.name != "initializer":
            _copy_field(light.graph, fd, value)
    light.graph.initializer.extend(t for t in g.initializer if t.name not in names)
    declared = {i.name for i in g.input}
    fake = {t.name for t in big if t.name not in declared}
    light.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in big if t.name in fake)
    return light, big, fake


def _copy_field(dst, fd, value) -> None:
    if fd.is_repeated:
        getattr(dst, fd.name).extend(value)
    elif fd.message_type is not None:
        getattr(dst, fd.name).CopyFrom(value)
    else:
        setattr(dst, fd.name, value)


def reweighted(light: onnx.ModelProto, big: list[onnx.TensorProto], fake: set[str]) -> onnx.ModelProto:
    """`light` (in place) with the initializers `weightless` took out back in."""
    if big:
        inputs = [i for i in light.graph.input if i.name not in fake]
        del light.graph.input[:]
        light.graph.input.extend(inputs)
        light.graph.initializer.extend(big)
    return light
