"""graph.light: onnxruntime sessions that take a model's large weights in memory, and in-place removal from repeated
protobuf fields."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from netquant.export.ort_kernels import save_optimized_graph
from netquant.graph.light import IN_MEMORY_MIN_BYTES, ort_session, remove_where, weights_apart
from tests.helpers.ir import make_model


def _qdq_matmul() -> onnx.ModelProto:
    """x[1, 8, 512] -> Q/DQ -> MatMul(DQ(int8 w [512, 256], per-channel scales)) -> MatMul(w2 [256, 128]) -> y:
    onnxruntime fuses the first into MatMulIntegerToFloat; w and w2 are 128 KB (in memory), the scales stay in the
    graph."""
    rng = np.random.default_rng(0)
    w = rng.integers(-127, 128, (512, 256)).astype(np.int8)
    inits = [numpy_helper.from_array(w, "w_q"),
             numpy_helper.from_array((rng.random(256) * 0.01 + 0.001).astype(np.float32), "w_s"),
             numpy_helper.from_array(np.zeros(256, np.int8), "w_z"),
             numpy_helper.from_array(np.array(0.05, np.float32), "x_s"),
             numpy_helper.from_array(np.array(128, np.uint8), "x_z"),
             numpy_helper.from_array(rng.standard_normal((256, 128)).astype(np.float32), "w2")]
    nodes = [helper.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["xq"]),
             helper.make_node("DequantizeLinear", ["xq", "x_s", "x_z"], ["xd"]),
             helper.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wd"], axis=1),
             helper.make_node("MatMul", ["xd", "wd"], ["a"]), helper.make_node("MatMul", ["a", "w2"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8, 128])], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _options(save: Path) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    save_optimized_graph(so, save)
    return so


def test_ort_session_takes_large_weights_in_memory_with_the_same_graph_and_outputs(tmp_path: Path) -> None:
    model = _qdq_matmul()
    before = model.SerializeToString()
    light, arrays = weights_apart(model)
    assert model.SerializeToString() == before  # the input is not touched
    assert sorted(arrays) == ["w2", "w_q"]  # 128 KB each; the scales and zero points stay in the graph
    assert all(a.nbytes >= IN_MEMORY_MIN_BYTES for a in arrays.values())
    np.testing.assert_array_equal(arrays["w_q"], numpy_helper.to_array(model.graph.initializer[0]))
    stand_in = {t.name: t for t in light.graph.initializer}["w_q"]
    assert stand_in.data_location == TensorProto.EXTERNAL and list(stand_in.dims) == [512, 256]
    assert len(light.SerializeToString()) < 8 * 1024

    x = np.random.default_rng(1).standard_normal((1, 8, 512)).astype(np.float32)
    plain = ort.InferenceSession(model.SerializeToString(), _options(tmp_path / "plain.onnx"),
                                 providers=["CPUExecutionProvider"])
    in_memory = ort_session(model, _options(tmp_path / "in_memory.onnx"))
    np.testing.assert_array_equal(in_memory.run(None, {"x": x})[0], plain.run(None, {"x": x})[0])
    ops = [Counter(n.op_type for n in onnx.load(str(tmp_path / f"{k}.onnx"), load_external_data=False).graph.node)
           for k in ("plain", "in_memory")]
    assert ops[0] == ops[1] and ops[1]["MatMulIntegerToFloat"] == 1  # the same fusions on the weights in memory
    # save_optimized_graph: the saved graph keeps its weights in a side file
    assert (tmp_path / "in_memory.onnx").stat().st_size < 16 * 1024
    assert (tmp_path / "in_memory.onnx.data").stat().st_size >= 128 * 1024


def test_ort_session_with_extra_outputs_and_a_model_without_large_weights() -> None:
    model = _qdq_matmul()
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort_session(model, so, outputs=["a"])
    assert [o.name for o in sess.get_outputs()] == ["y", "a"]
    x = np.random.default_rng(2).standard_normal((1, 8, 512)).astype(np.float32)
    y, a = sess.run(None, {"x": x})
    np.testing.assert_allclose(y, a @ numpy_helper.to_array(model.graph.initializer[-1]), rtol=1e-4, atol=1e-4)
    small = make_model(helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                                               [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])],
                                               [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert weights_apart(small) == (small, {})
    np.testing.assert_array_equal(ort_session(small, ort.SessionOptions()).run(None, {"x": np.array([-1.0, 0.0, 2.0],
                                                                                                    np.float32)})[0],
                                  [0.0, 0.0, 2.0])


def test_remove_where_deletes_in_place_and_keeps_the_rest_as_they_were() -> None:
    model = _qdq_matmul()
    kept_before = [t.SerializeToString() for t in model.graph.initializer if t.name not in ("w_z", "x_s")]
    assert remove_where(model.graph.initializer, lambda t: t.name in ("w_z", "x_s")) == 2
    assert [t.SerializeToString() for t in model.graph.initializer] == kept_before
    assert remove_where(model.graph.initializer, lambda t: False) == 0


def test_fill_initializer_writes_a_header_and_refuses_a_value_of_another_shape() -> None:
    import pytest
    import torch

    from netquant.graph.save import fill_initializer

    header = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2, 3])
    value = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    fill_initializer(header, value)
    np.testing.assert_array_equal(numpy_helper.to_array(header), value.numpy())
    with pytest.raises(ValueError, match="initializer 'w'"):
        fill_initializer(TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[3, 2]), value)
