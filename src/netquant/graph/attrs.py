"""ONNX AttributeProto <-> python values (the decoding op implementations receive).

    FLOAT -> float      INT -> int      STRING -> str (utf-8; bytes if not valid utf-8)
    TENSOR -> torch.Tensor (string tensors: numpy object array)      GRAPH -> netquant Graph
    FLOATS / INTS / STRINGS / TENSORS / GRAPHS -> lists of the above
    SPARSE_TENSOR(S), TYPE_PROTO(S) -> the onnx protobuf messages, untouched
The attribute type is remembered next to the value (Node.attr_types) so encoding is exact even for
empty lists.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch
from onnx import AttributeProto

from netquant.graph.dtypes import tensor_from_proto, tensor_to_proto

A = AttributeProto
GraphDecoder = Callable[[onnx.GraphProto], Any]
GraphEncoder = Callable[[Any], onnx.GraphProto]


def _decode_str(raw: bytes) -> str | bytes:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _decode_tensor(proto: onnx.TensorProto) -> torch.Tensor | np.ndarray:
    value, _ = tensor_from_proto(proto, where="attribute tensor")
    return value


def decode_attribute(attr: AttributeProto, decode_graph: GraphDecoder | None = None) -> Any:
    """Python value of one attribute (see module docstring)."""
    t = attr.type
    if t == A.FLOAT:
        return float(attr.f)
    if t == A.INT:
        return int(attr.i)
    if t == A.STRING:
        return _decode_str(attr.s)
    if t == A.TENSOR:
        return _decode_tensor(attr.t)
    if t == A.GRAPH:
        return decode_graph(attr.g) if decode_graph else attr.g
    if t == A.FLOATS:
        return [float(f) for f in attr.floats]
    if t == A.INTS:
        return [int(i) for i in attr.ints]
    if t == A.STRINGS:
        return [_decode_str(s) for s in attr.strings]
    if t == A.TENSORS:
        return [_decode_tensor(x) for x in attr.tensors]
    if t == A.GRAPHS:
        return [decode_graph(g) if decode_graph else g for g in attr.graphs]
    if t == A.SPARSE_TENSOR:
        return attr.sparse_tensor
    if t == A.SPARSE_TENSORS:
        return list(attr.sparse_tensors)
    if t == A.TYPE_PROTO:
        return attr.tp
    if t == A.TYPE_PROTOS:
        return list(attr.type_protos)
    # attribute without a type: infer from the filled field (old exporters)
    return onnx.helper.get_attribute_value(attr)


def infer_attribute_type(value: Any) -> int:
    """AttributeType for a python value whose type was not recorded."""
    from netquant.graph.ir import Graph

    if isinstance(value, bool | int | np.integer):
        return A.INT
    if isinstance(value, float | np.floating):
        return A.FLOAT
    if isinstance(value, str | bytes):
        return A.STRING
    if isinstance(value, torch.Tensor | np.ndarray | onnx.TensorProto):
        return A.TENSOR
    if isinstance(value, Graph | onnx.GraphProto):
        return A.GRAPH
    if isinstance(value, onnx.SparseTensorProto):
        return A.SPARSE_TENSOR
    if isinstance(value, onnx.TypeProto):
        return A.TYPE_PROTO
    if isinstance(value, list | tuple):
        if not value:
            return A.INTS
        kinds = {infer_attribute_type(v) for v in value}
        if kinds <= {A.INT, A.FLOAT}:
            return A.FLOATS if A.FLOAT in kinds else A.INTS
        one = kinds.pop()
        return {A.STRING: A.STRINGS, A.TENSOR: A.TENSORS, A.GRAPH: A.GRAPHS,
                A.SPARSE_TENSOR: A.SPARSE_TENSORS, A.TYPE_PROTO: A.TYPE_PROTOS}[one]
    raise TypeError(f"cannot encode attribute value of type {type(value).__name__}")


def _enc_tensor(value: Any) -> onnx.TensorProto:
    return value if isinstance(value, onnx.TensorProto) else tensor_to_proto(value)


def _enc_str(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode("utf-8")


def encode_attribute(name: str, value: Any, attr_type: int | None = None,
                     encode_graph: GraphEncoder | None = None) -> AttributeProto:
    """AttributeProto for a decoded value; attr_type (if known) fixes the exact type."""
    t = attr_type if attr_type else infer_attribute_type(value)
    attr = AttributeProto()
    attr.name = name
    attr.type = t

    def graph(g: Any) -> onnx.GraphProto:
        return g if isinstance(g, onnx.GraphProto) else encode_graph(g)  # type: ignore[misc]

    if t == A.FLOAT:
        attr.f = float(value)
    elif t == A.INT:
        attr.i = int(value)
    elif t == A.STRING:
        attr.s = _enc_str(value)
    elif t == A.TENSOR:
        attr.t.CopyFrom(_enc_tensor(value))
    elif t == A.GRAPH:
        attr.g.CopyFrom(graph(value))
    elif t == A.FLOATS:
        attr.floats.extend(float(v) for v in value)
    elif t == A.INTS:
        attr.ints.extend(int(v) for v in value)
    elif t == A.STRINGS:
        attr.strings.extend(_enc_str(v) for v in value)
    elif t == A.TENSORS:
        attr.tensors.extend(_enc_tensor(v) for v in value)
    elif t == A.GRAPHS:
        attr.graphs.extend(graph(g) for g in value)
    elif t == A.SPARSE_TENSOR:
        attr.sparse_tensor.CopyFrom(value)
    elif t == A.SPARSE_TENSORS:
        attr.sparse_tensors.extend(value)
    elif t == A.TYPE_PROTO:
        attr.tp.CopyFrom(value)
    elif t == A.TYPE_PROTOS:
        attr.type_protos.extend(value)
    else:
        raise TypeError(f"attribute '{name}': unknown attribute type {t}")
    return attr
