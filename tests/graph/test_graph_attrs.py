"""Attribute decoding / encoding and tensor conversion round trips (every AttributeProto type, every ONNX
element type torch can hold, sub-byte stand-ins, strings)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import AttributeProto as A
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from netquant.graph import Graph, load_onnx, to_onnx
from netquant.graph.attrs import decode_attribute, encode_attribute, infer_attribute_type
from netquant.graph.dtypes import (
    ONNX_TO_TORCH,
    STAND_IN,
    numpy_to_torch,
    tensor_from_proto,
    tensor_to_proto,
    torch_to_numpy,
)
from tests.helpers.ir import make_model


def _same_attr(a: onnx.AttributeProto, b: onnx.AttributeProto) -> bool:
    return a.SerializeToString(deterministic=True) == b.SerializeToString(deterministic=True)


SUB = oh.make_graph([oh.make_node("Relu", ["x"], ["y"])], "body", [oh.make_tensor_value_info("x", TP.FLOAT, [2])],
                    [oh.make_tensor_value_info("y", TP.FLOAT, [2])])

ATTRS = [
    oh.make_attribute("f", 0.1),
    oh.make_attribute("i", -7),
    oh.make_attribute("s", "SAME_UPPER"),
    oh.make_attribute("t", nh.from_array(np.arange(6, dtype=np.float16).reshape(2, 3))),
    oh.make_attribute("floats", [1.5, -2.25, 1e-8]),
    oh.make_attribute("ints", [1, -2, 2**40]),
    oh.make_attribute("strings", ["a", "bé"]),
    oh.make_attribute("tensors", [nh.from_array(np.array([1, 2], np.int64)), nh.from_array(np.array(True))]),
    oh.make_attribute("empty_ints", [], attr_type=A.INTS),
    oh.make_attribute("empty_floats", [], attr_type=A.FLOATS),
    oh.make_attribute("tp", oh.make_tensor_type_proto(TP.FLOAT, [2, "n"])),
]


@pytest.mark.parametrize("attr", ATTRS, ids=[a.name for a in ATTRS])
def test_attribute_round_trip_is_exact(attr: onnx.AttributeProto) -> None:
    value = decode_attribute(attr)
    again = encode_attribute(attr.name, value, attr.type)
    assert _same_attr(attr, again)


def test_decoded_python_types() -> None:
    by_name = {a.name: decode_attribute(a) for a in ATTRS}
    assert isinstance(by_name["f"], float) and by_name["f"] == np.float32(0.1)
    assert by_name["i"] == -7 and by_name["s"] == "SAME_UPPER"
    assert isinstance(by_name["t"], torch.Tensor) and by_name["t"].dtype == torch.float16
    assert by_name["ints"] == [1, -2, 2**40] and by_name["strings"] == ["a", "bé"]
    assert by_name["tensors"][1].dtype == torch.bool


def test_non_utf8_string_stays_bytes() -> None:
    attr = oh.make_attribute("s", b"\xff\xfe")
    assert decode_attribute(attr) == b"\xff\xfe"
    assert _same_attr(attr, encode_attribute("s", b"\xff\xfe", A.STRING))


def test_graph_attribute_decodes_to_graph_and_back() -> None:
    attr = oh.make_attribute("body", SUB)
    g = decode_attribute(attr, decode_graph=lambda gp: load_onnx(
        make_model(gp, opset_imports=[oh.make_opsetid("", 17)]), infer_shapes=False))
    assert isinstance(g, Graph) and [n.op_type for n in g.nodes] == ["Relu"]


def test_infer_attribute_type() -> None:
    assert infer_attribute_type(3) == A.INT and infer_attribute_type(3.0) == A.FLOAT
    assert infer_attribute_type([1, 2.5]) == A.FLOATS and infer_attribute_type([]) == A.INTS
    assert infer_attribute_type(["a"]) == A.STRINGS and infer_attribute_type(torch.ones(2)) == A.TENSOR
    with pytest.raises(TypeError):
        infer_attribute_type(object())


def test_node_attributes_survive_model_round_trip() -> None:
    node = oh.make_node("Custom", ["x"], ["y"], domain="my.domain")
    node.attribute.extend(a for a in ATTRS if a.name != "tp")
    graph = oh.make_graph([node], "g", [oh.make_tensor_value_info("x", TP.FLOAT, [2])],
                          [oh.make_tensor_value_info("y", TP.FLOAT, [2])])
    model = make_model(graph, opset_imports=[oh.make_opsetid("", 17), oh.make_opsetid("my.domain", 1)])
    back = to_onnx(load_onnx(model, infer_shapes=False), check=False)
    for a, b in zip(model.graph.node[0].attribute, back.graph.node[0].attribute):
        assert _same_attr(a, b), a.name


# ------------------------------------------------------------------------ tensors
NATIVE_TYPES = sorted(ONNX_TO_TORCH)


@pytest.mark.parametrize("elem_type", NATIVE_TYPES, ids=[TP.DataType.Name(t) for t in NATIVE_TYPES])
def test_tensor_proto_round_trip_every_type(elem_type: int) -> None:
    np_type = oh.tensor_dtype_to_np_dtype(elem_type)
    rng = np.random.default_rng(elem_type)
    raw = rng.standard_normal((3, 4)) * 4
    if np.issubdtype(np_type, np.complexfloating):
        raw = raw + 1j * raw[::-1]
    arr = raw.astype(np_type) if np.dtype(np_type) != np.bool_ else raw > 0
    proto = nh.from_array(arr, "t")
    value, et = tensor_from_proto(proto)
    assert et == elem_type and value.dtype == ONNX_TO_TORCH[elem_type] and tuple(value.shape) == (3, 4)
    back = tensor_to_proto(value, "t")
    assert back.data_type == elem_type
    got = nh.to_array(back)
    assert got.dtype == arr.dtype and got.tobytes() == arr.tobytes()
    assert torch_to_numpy(value).tobytes() == arr.tobytes()


@pytest.mark.parametrize("elem_type", sorted(STAND_IN), ids=[TP.DataType.Name(t) for t in sorted(STAND_IN)])
def test_sub_byte_types_use_stand_ins(elem_type: int) -> None:
    np_type = oh.tensor_dtype_to_np_dtype(elem_type)
    info = ml_dtypes.finfo(np_type) if "float" in np.dtype(np_type).name else ml_dtypes.iinfo(np_type)
    vals = np.array([info.min, 0, info.max, 1], dtype=np_type)
    proto = oh.make_tensor("t", elem_type, [4], vals.astype(np.float32).tolist())
    value, et = tensor_from_proto(proto)
    assert et == elem_type and value.dtype == STAND_IN[elem_type]
    assert value.tolist() == vals.astype(np.float32).tolist()
    back = tensor_to_proto(value, "t", elem_type)
    assert back.data_type == elem_type
    assert np.array_equal(nh.to_array(back).astype(np.float32), vals.astype(np.float32))


def test_string_tensor_stays_numpy() -> None:
    arr = np.array(["a", "bc"], dtype=object)
    value, et = tensor_from_proto(nh.from_array(arr, "s"))
    assert et == TP.STRING and isinstance(value, np.ndarray) and value.dtype == object
    assert [v.decode() if isinstance(v, bytes) else v for v in value] == ["a", "bc"]


@settings(max_examples=60, deadline=None)
@given(shape=st.lists(st.integers(0, 4), max_size=4),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int64,
                              torch.float8_e4m3fn, torch.float8_e5m2, torch.bool, torch.uint16]))
def test_torch_numpy_proto_round_trip_property(shape: list[int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(len(shape))
    t = (torch.randn(shape, generator=g) * 3).to(dtype) if dtype != torch.uint16 else \
        torch.randint(0, 60000, shape, generator=g, dtype=torch.int32).to(torch.uint16)
    def bits(x: torch.Tensor) -> torch.Tensor:
        if x.numel() == 0 or x.dtype == torch.bool:
            return x.reshape(-1).to(torch.uint8) if x.dtype == torch.bool else torch.empty(0, dtype=torch.uint8)
        return x.contiguous().reshape(-1).view(torch.uint8)

    via_numpy = numpy_to_torch(torch_to_numpy(t))
    assert via_numpy.dtype == t.dtype and via_numpy.shape == t.shape and torch.equal(bits(via_numpy), bits(t))
    back, _ = tensor_from_proto(tensor_to_proto(t, "x"))
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(bits(back), bits(t))
