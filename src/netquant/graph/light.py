"""Copies of an ONNX model that leave its weights' payloads behind: everything but the main graph's initializers
copied, each initializer replaced where a rule says (graph.checker, graph.shape_inference), and onnxruntime sessions
that take the large weights in memory (ort_session)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
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


def without_initializers(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` with every field but the main graph's initializers (no copy of the weights)."""
    out = onnx.ModelProto()
    copy_fields(model, out, skip="graph")
    copy_fields(model.graph, out.graph, skip="initializer")
    return out


def remove_where(repeated: Any, drop: Callable[[Any], bool]) -> int:
    """Delete the elements of a repeated protobuf field for which drop(element) holds, in place: the kept ones are
    neither copied nor moved out (rebuilding the field with extend() copies every kept tensor's payload: 0.2-0.7 s
    for BERT-base's initializers). Returns how many were deleted."""
    gone = [i for i, element in enumerate(repeated) if drop(element)]
    for i in reversed(gone):
        del repeated[i]
    return len(gone)


def with_initializers(model: onnx.ModelProto,
                      replace: Callable[[onnx.TensorProto], onnx.TensorProto | None]) -> onnx.ModelProto | None:
    """A copy of `model` whose main-graph initializers are replace(t) where that is a tensor, t itself where it is
    None; None (no copy) when it replaces none."""
    inits = model.graph.initializer
    new = [replace(t) for t in inits]
    if all(n is None for n in new):
        return None
    light = without_initializers(model)
    for t, n in zip(inits, new, strict=True):
        light.graph.initializer.append(t if n is None else n)
    return light


def tensor_bytes(t: onnx.TensorProto) -> int:
    """A tensor's data size from its header (numel x element size, 1 byte where the type has no numpy size; upb's
    ByteSize serializes the tensor to tell)."""
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        itemsize = 1
    return math.prod(int(d) for d in t.dims) * max(1, itemsize)


IN_MEMORY_MIN_BYTES = 1 << 16  # initializers at least this large go to onnxruntime in memory (ort_session)
_IN_MEMORY_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE,
                              onnx.TensorProto.INT8, onnx.TensorProto.UINT8, onnx.TensorProto.INT16,
                              onnx.TensorProto.UINT16, onnx.TensorProto.INT32, onnx.TensorProto.UINT32,
                              onnx.TensorProto.INT64, onnx.TensorProto.UINT64})
_IN_MEMORY = "netquant-in-memory"  # the location the stand-ins name (onnxruntime never opens it)


def weights_apart(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """(model with each main-graph initializer of IN_MEMORY_MIN_BYTES or more raw bytes (numeric types, not a graph
    input) replaced by an external-data stand-in of the same name, type and dims; those tensors as arrays). The
    model itself and {} where there is none."""
    inputs = {v.name for v in model.graph.input}
    arrays: dict[str, np.ndarray] = {}

    def stand_in(t: onnx.TensorProto) -> onnx.TensorProto | None:
        if t.data_type not in _IN_MEMORY_TYPES or t.name in inputs or t.data_location == onnx.TensorProto.EXTERNAL \
                or not t.HasField("raw_data"):
            return None
        if tensor_bytes(t) < IN_MEMORY_MIN_BYTES:
            return None
        arrays[t.name] = np.frombuffer(t.raw_data, onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).reshape(
            tuple(t.dims))
        out = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims,
                               data_location=onnx.TensorProto.EXTERNAL)
        out.external_data.add(key="location", value=_IN_MEMORY)
        return out

    light = with_initializers(model, stand_in)
    return (model, {}) if light is None else (light, arrays)


def with_outputs(model: onnx.ModelProto, names: Sequence[str]) -> bytes:
    """The serialized `model` with float graph outputs `names` appended, without copying the proto: protobuf parses
    concatenated messages as one, merged (repeated fields appended), so the extra outputs are a second, small
    ModelProto's bytes after the model's."""
    if not names:
        return model.SerializeToString()
    extra = onnx.ModelProto()
    extra.graph.output.extend(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None) for n in names)
    return model.SerializeToString() + extra.SerializeToString()


def ort_session(model: onnx.ModelProto, options: Any, outputs: Sequence[str] = (),
                providers: tuple[str, ...] = ("CPUExecutionProvider",)) -> Any:
    """onnxruntime.InferenceSession of `model` (float graph outputs `outputs` appended: with_outputs) whose large
    weights reach onnxruntime in memory (SessionOptions.add_external_initializers on weights_apart's arrays, kept
    alive on the session) instead of serialized with the graph: BERT-base's FP32 session builds in 0.4-0.6 s instead
    of 1.1-1.7 s; the same graph optimizations and outputs (tests). `options` is modified."""
    import onnxruntime as ort

    light, arrays = weights_apart(model) if hasattr(options, "add_external_initializers") else (model, {})
    values = [ort.OrtValue.ortvalue_from_numpy(a) for a in arrays.values()]
    if arrays:
        options.add_external_initializers(list(arrays), values)
    session = ort.InferenceSession(with_outputs(light, outputs), options, providers=list(providers))
    session.netquant_weights = (arrays, values)  # onnxruntime reads their memory for the session's life
    return session
