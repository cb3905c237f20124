"""graph.shape_inference: onnx inference without the float weights' payloads gives onnx's own shapes."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from netquant.graph.shape_inference import infer_model_shapes
from tests.helpers.ir import make_model


def _model() -> onnx.ModelProto:
    """x [B, 16] @ W [16, 256] -> Reshape to [B, 16, 16] through Shape / Gather / Concat (data propagation of int64
    values), + a small float bias; W (16 KiB) is stripped, the int64 tensors and the bias are not."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((16, 256)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal((16,)).astype(np.float32), "b"),
             numpy_helper.from_array(np.array([0], np.int64), "i0"),
             numpy_helper.from_array(np.array([16, 16], np.int64), "tail")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["y"], name="mm"),
             helper.make_node("Shape", ["x"], ["sx"], name="shape"),
             helper.make_node("Gather", ["sx", "i0"], ["batch"], name="gather"),
             helper.make_node("Concat", ["batch", "tail"], ["target"], axis=0, name="concat"),
             helper.make_node("Reshape", ["y", "target"], ["r"], name="reshape"),
             helper.make_node("Add", ["r", "b"], ["z"], name="add")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 16])],
                              [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_shapes_without_weight_payloads_equal_onnx_inference_on_the_whole_model() -> None:
    model = _model()
    before = model.SerializeToString()
    got = infer_model_shapes(model)
    want = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    assert got is not None
    assert [v.SerializeToString() for v in (*got.graph.value_info, *got.graph.output)] == \
        [v.SerializeToString() for v in (*want.graph.value_info, *want.graph.output)]
    shapes = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in got.graph.value_info}
    assert shapes["r"] == ["B", 16, 16] and shapes["y"] == ["B", 256]  # data propagation still reads the int64s
    inits = {t.name: t for t in got.graph.initializer}
    assert not inits["W"].raw_data and list(inits["W"].dims) == [16, 256]  # the weight left out
    assert inits["b"].raw_data and inits["tail"].raw_data  # small and integer tensors kept
    assert model.SerializeToString() == before  # the caller's model is not changed
