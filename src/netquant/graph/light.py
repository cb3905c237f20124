"""Copies of an ONNX model that leave its weights' payloads behind: everything but the main graph's initializers
copied, each initializer replaced where a rule says (graph.checker, graph.shape_inference)."""

from __future__ import annotations

from collections.abc import Callable

import onnx
from google.protobuf.message import Message


def copy_fields(src: Message, dst: Message, skip: str) -> None:
    """Every set field of `src` but `skip` into `dst` (same message type)."""
    for desc, value in src.ListFields():
        if desc.name == skip:
            continue
        if desc.is_repeated:
            getattr(dst, desc.name).extend(value)
        elif desc.message_type is not None:
            getattr(dst, desc.name).CopyFrom(value)
        else:
            setattr(dst, desc.name, value)


def with_initializers(model: onnx.ModelProto,
                      replace: Callable[[onnx.TensorProto], onnx.TensorProto | None]) -> onnx.ModelProto | None:
    """A copy of `model` whose main-graph initializers are replace(t) where that is a tensor, t itself where it is
    None; None (no copy) when it replaces none."""
    inits = model.graph.initializer
    new = [replace(t) for t in inits]
    if all(n is None for n in new):
        return None
    light = onnx.ModelProto()
    copy_fields(model, light, skip="graph")
    copy_fields(model.graph, light.graph, skip="initializer")
    for t, n in zip(inits, new, strict=True):
        light.graph.initializer.append(t if n is None else n)
    return light
