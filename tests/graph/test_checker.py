"""graph.checker: onnx.checker's verdict on a model's structure without its weights' payloads."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from netquant.graph.checker import STRUCTURE_BYTES, check_structure, structural_copy
from tests.helpers.ir import make_model


def _model(output_shape: bool = True, op: str = "MatMul") -> onnx.ModelProto:
    """x[2, 512] -> MatMul w[512, 256] (512 KB of float32) + b[256] -> y, with a small int64 shape constant and an
    int8 and a float16 table beside them."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((512, 256)).astype(np.float32), "w"),
             numpy_helper.from_array(rng.standard_normal(256).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([2, 256], np.int64), "shape"),
             numpy_helper.from_array(rng.integers(-127, 127, (64, 128)).astype(np.int8), "table_i8"),
             numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float16), "table_f16")]
    nodes = [helper.make_node(op, ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Reshape", ["a", "shape"], ["y"])]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 256] if output_shape else None)
    if not output_shape:
        out.type.tensor_type.ClearField("elem_type")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 512])], [out],
                              inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_large_initializers_become_one_element_of_their_type_and_the_rest_is_kept() -> None:
    model = _model()
    before = model.SerializeToString()
    light = structural_copy(model)
    assert model.SerializeToString() == before  # the input is not touched
    got = {t.name: t for t in light.graph.initializer}
    for t in model.graph.initializer:
        size = numpy_helper.to_array(t).nbytes
        assert got[t.name].data_type == t.data_type
        if size >= STRUCTURE_BYTES:
            assert list(got[t.name].dims) == [1] and numpy_helper.to_array(got[t.name]).size == 1
        else:
            assert got[t.name] == t
    assert light.graph.node == model.graph.node and light.opset_import == model.opset_import
    assert light.ir_version == model.ir_version and light.graph.output == model.graph.output
    assert light.ByteSize() < 2048 < model.ByteSize() // 100


def test_the_checker_verdict_is_the_full_models() -> None:
    check_structure(_model())  # valid: no error
    onnx.checker.check_model(_model())
    for bad in (_model(output_shape=False), _model(op="NoSuchOp")):
        with pytest.raises(onnx.checker.ValidationError) as full:
            onnx.checker.check_model(bad)
        with pytest.raises(onnx.checker.ValidationError) as structural:
            check_structure(bad)
        assert str(structural.value).splitlines()[0] == str(full.value).splitlines()[0]


def test_a_model_without_large_initializers_is_checked_as_it_is() -> None:
    small = make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]), opset_imports=[helper.make_opsetid("", 17)])
    assert structural_copy(small) is small
