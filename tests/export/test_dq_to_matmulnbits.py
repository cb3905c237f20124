"""Blocked integer DequantizeLinear weights -> com.microsoft.MatMulNBits: onnxruntime computes the same outputs."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from netquant.export.weight_only import dq_weights_to_matmulnbits
from netquant.nn.integer_weights import integer_tensor
from tests.helpers.ir import make_model

K, N = 80, 24


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


def _dq_model(elem: int, block: int, with_zero: bool, layout: str, bias: bool = False) -> onnx.ModelProto:
    """x [2, 3, K] (or [3, K] for Gemm) times a DQ weight stored as [K, N] ("matmul", "gemm": axis 0) or [N, K]
    ("gemm_t": Gemm transB=1, "transpose": Transpose -> MatMul; axis 1); blocks run along K."""
    rng = np.random.default_rng(1)
    lo, hi = {TensorProto.INT4: (-8, 7), TensorProto.UINT4: (0, 15), TensorProto.INT8: (-128, 127),
              TensorProto.UINT8: (0, 255)}[elem]
    stored_nk = layout in ("gemm_t", "transpose")
    shape = (N, K) if stored_nk else (K, N)
    axis = 1 if stored_nk else 0
    blocks = -(-K // block)
    p_shape = (N, blocks) if stored_nk else (blocks, N)
    q = rng.integers(lo, hi + 1, shape)
    inits = [integer_tensor("wq", q, elem),
             numpy_helper.from_array(rng.uniform(0.01, 0.1, p_shape).astype(np.float32), "ws")]
    dq_inputs = ["wq", "ws"]
    if with_zero:
        inits.append(integer_tensor("wz", rng.integers(lo // 2, hi // 2 + 1, p_shape), elem))
        dq_inputs.append("wz")
    nodes = [helper.make_node("DequantizeLinear", dq_inputs, ["w"], axis=axis, block_size=block)]
    if layout == "transpose":
        nodes.append(helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]))
        nodes.append(helper.make_node("MatMul", ["x", "wt"], ["y"]))
    elif layout == "matmul":
        nodes.append(helper.make_node("MatMul", ["x", "w"], ["y"]))
    elif layout == "matmul_add":  # the bias Add folds into MatMulNBits' bias input
        inits.append(numpy_helper.from_array(np.linspace(-1, 1, N, dtype=np.float32), "b"))
        nodes += [helper.make_node("MatMul", ["x", "w"], ["mm"]), helper.make_node("Add", ["b", "mm"], ["y"])]
    else:
        inputs = ["x", "w"] + (["b"] if bias else [])
        if bias:
            inits.append(numpy_helper.from_array(np.linspace(-1, 1, N, dtype=np.float32), "b"))
        nodes.append(helper.make_node("Gemm", inputs, ["y"], transB=int(layout == "gemm_t")))
    x_shape = [3, K] if layout.startswith("gemm") else [2, 3, K]
    y_shape = x_shape[:-1] + [N]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(("elem", "block", "with_zero", "layout"), [
    (TensorProto.INT4, 16, False, "matmul"), (TensorProto.INT4, 32, True, "transpose"),
    (TensorProto.UINT4, 32, True, "gemm_t"), (TensorProto.UINT4, 16, False, "gemm"),
    (TensorProto.INT8, 64, False, "gemm_t"), (TensorProto.UINT8, 16, True, "matmul"),
    (TensorProto.INT4, 16, True, "matmul_add")])
def test_matmulnbits_computes_what_the_dq_graph_computes(elem: int, block: int, with_zero: bool, layout: str) -> None:
    model = _dq_model(elem, block, with_zero, layout, bias=layout.startswith("gemm"))
    x = np.random.default_rng(2).standard_normal([3, K] if layout.startswith("gemm") else [2, 3, K]).astype(np.float32)
    want = _run(model, x)
    assert dq_weights_to_matmulnbits(model) == 1
    ops = [n.op_type for n in model.graph.node]
    assert ops == ["MatMulNBits"], ops
    node = model.graph.node[0]
    assert (len(node.input) > 5 and node.input[5] == "b") == (layout in ("gemm_t", "gemm", "matmul_add"))
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert (attrs["K"], attrs["N"], attrs["block_size"]) == (K, N, block)
    assert attrs["bits"] == (4 if elem in (TensorProto.INT4, TensorProto.UINT4) else 8)
    # zero points are written unless they are all the signed types' implicit 2^(bits-1)
    assert (len(node.input) > 3 and node.input[3] != "") == (with_zero or elem in (TensorProto.UINT4, TensorProto.UINT8))
    assert {t.name for t in model.graph.initializer}.isdisjoint({"wq", "ws", "wz"})
    onnx.checker.check_model(model)
    np.testing.assert_allclose(_run(model, x), want, rtol=1e-5, atol=1e-5)


def test_weights_it_cannot_express_stay_dq() -> None:
    per_channel = _dq_model(TensorProto.INT4, 16, False, "matmul")
    dq = per_channel.graph.node[0]
    del dq.attribute[:]
    dq.attribute.extend([helper.make_attribute("axis", 1)])
    per_channel.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.full(N, 0.05, np.float32), "ws"))
    assert dq_weights_to_matmulnbits(per_channel) == 0  # per-channel: no block along K

    along_n = _dq_model(TensorProto.INT4, 16, False, "gemm_t")
    along_n.graph.node[1].attribute[0].i = 0  # transB=0: the stored [N, K] would be [K, N]: blocks run along N
    assert dq_weights_to_matmulnbits(along_n) == 0

    shared = _dq_model(TensorProto.INT4, 16, False, "matmul")
    shared.graph.node.append(helper.make_node("Identity", ["w"], ["w_copy"]))
    shared.graph.output.append(helper.make_tensor_value_info("w_copy", TensorProto.FLOAT, [K, N]))
    assert dq_weights_to_matmulnbits(shared) == 0
    assert [n.op_type for n in shared.graph.node] == ["DequantizeLinear", "MatMul", "Identity"]
