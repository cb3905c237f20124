"""Integer weight storage of module exports: Q -> DQ on constant weights folds into integer initializer -> DQ;
the files shrink (int4 ~ 1/8, int8 ~ 1/4 of FP32) and onnxruntime computes what the module's fake quantization does."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import netquant.nn as nqnn
from netquant.core.ops import GradMode
from netquant.nn.integer_weights import (
    fold_weight_qdq,
    integer_tensor,
    quantize_linear,
    reorient_blocked_weights,
)
from tests.helpers.ir import make_model


def _session(path: Path | bytes, literal: bool = False) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    if literal:
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(path if isinstance(path, bytes) else str(path), opts,
                                providers=["CPUExecutionProvider"])


def _run(path: Path, x: torch.Tensor, literal: bool = False) -> np.ndarray:
    session = _session(path, literal)
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


def _float_bytes(model: nn.Module) -> int:
    return sum(p.numel() * 4 for p in model.parameters())


def _mlp(width: int = 1024) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width))


def _types(proto: onnx.ModelProto) -> tuple[list[int], list[str]]:
    """Element types of the initializers DequantizeLinear reads as data, and the Q nodes reading an initializer."""
    inits = {t.name: t for t in proto.graph.initializer}
    dq = [inits[n.input[0]].data_type for n in proto.graph.node
          if n.op_type == "DequantizeLinear" and n.input[0] in inits]
    q = [n.name for n in proto.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in inits]
    return dq, q


def test_w4a16_mlp_is_stored_in_int4_and_runs_as_the_module(tmp_path: Path) -> None:
    model = _mlp()
    q = nqnn.quantize_model(model, nqnn.ModelQuantConfig.w4a16())
    x = torch.randn(4, 1024)
    path = nqnn.export_onnx(q, x, tmp_path / "w4a16.onnx")
    size = path.stat().st_size
    fp32 = _float_bytes(model)
    assert size < 0.2 * fp32, size / fp32
    assert size < 0.16 * fp32  # int4 codes (1/8) + a float scale and an int4 zero point per 128 weights + graph
    proto = onnx.load(path)
    dq_types, q_nodes = _types(proto)
    assert dq_types == [TensorProto.INT4] * 3 and not q_nodes
    # the form engines match: W^T [K, N] int4, blocks along axis 0 -> MatMul (+ Add for the bias)
    assert [n.op_type for n in proto.graph.node] == ["DequantizeLinear", "MatMul", "Add", "Relu"] * 2 + [
        "DequantizeLinear", "MatMul", "Add"]
    inits = {t.name: t for t in proto.graph.initializer}
    dq = proto.graph.node[0]
    assert [a.i for a in dq.attribute if a.name == "axis"] == [0] and list(inits[dq.input[1]].dims) == [8, 1024]
    with torch.no_grad():
        ref = q(x).numpy()
    np.testing.assert_allclose(_run(path, x, literal=True), ref, rtol=1e-4, atol=1e-5)  # as written
    # onnxruntime's fusions: DQ -> MatMul runs as MatMulNBits with int8 activations (its default accuracy level 4)
    assert np.abs(_run(path, x) - ref).max() < 0.02 * np.abs(ref).max()


def _qat_int8(steps: int = 5) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10))
    x = torch.randn(64, 256)
    y = torch.randint(0, 10, (64,))
    q = nqnn.quantize_model(model, nqnn.ModelQuantConfig.int8_tensorrt())
    with nqnn.calibrate(q):
        q(x)
    nqnn.prepare_qat(q, grad_mode=GradMode.LSQ)
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    q.train()
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(q(x), y).backward()
        opt.step()
    q.eval()
    return model, q, x


def test_qat_int8_export_has_int8_weights_and_matches_the_fake_quant_forward(tmp_path: Path) -> None:
    model, q, x = _qat_int8()
    weights_before = q[2].weight.detach().clone()
    path = nqnn.export_onnx(q, x[:8], tmp_path / "qat.onnx")
    assert torch.equal(q[2].weight, weights_before)  # the module is left as it was
    proto = onnx.load(path)
    dq_types, q_nodes = _types(proto)
    assert dq_types == [TensorProto.INT8] * 3 and not q_nodes
    float_2d = [t.name for t in proto.graph.initializer if t.data_type == TensorProto.FLOAT and len(t.dims) == 2]
    assert not float_2d
    payload = sum(len(t.raw_data) for t in proto.graph.initializer) / _float_bytes(model)
    assert 0.25 < payload < 0.26, payload  # int8 weights, float32 biases and per-channel scales
    assert path.stat().st_size < 0.28 * _float_bytes(model)  # + the exporter's graph metadata
    with torch.no_grad():
        ref = q(x).numpy()
    np.testing.assert_allclose(_run(path, x, literal=True), ref, rtol=1e-4, atol=1e-4)
    fused = _run(path, x)  # onnxruntime's int8 kernels: integer accumulation, float requantization
    assert np.abs(fused - ref).max() < 0.02 * np.abs(ref).max()


def _q_model(x: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, elem: int, axis: int, block: int
             ) -> onnx.ModelProto:
    attrs = {"axis": axis} | ({"block_size": block} if block else {})
    inits = [numpy_helper.from_array(x, "w"), numpy_helper.from_array(scale, "s")]
    names = ["w", "s"]
    if zero is not None:
        inits.append(helper.make_tensor("z", elem, list(zero.shape), zero.reshape(-1).tolist()))
        names.append("z")
    q_attrs = attrs | ({"output_dtype": elem} if zero is None and elem != TensorProto.UINT8 else {})
    nodes = [helper.make_node("QuantizeLinear", names, ["q"], **q_attrs),
             helper.make_node("DequantizeLinear", ["q", *names[1:]], ["d"], **attrs),
             helper.make_node("Mul", ["a", "d"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", TensorProto.FLOAT, list(x.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)


@pytest.mark.parametrize(("elem", "axis", "block", "with_zero"), [
    (TensorProto.INT4, 1, 16, True), (TensorProto.UINT4, 0, 16, True), (TensorProto.INT8, 0, 0, True),
    (TensorProto.UINT8, 1, 0, False), (TensorProto.INT8, 0, 0, False), (TensorProto.UINT16, 1, 32, True)])
def test_fold_is_exact_against_onnxruntime_quantize_linear(elem: int, axis: int, block: int, with_zero: bool) -> None:
    """Arbitrary floats (not fake-quantized, with ties and out-of-range values): the folded integers equal
    onnxruntime's QuantizeLinear, so the folded graph's output is bit-identical."""
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40, 48)) * 3).astype(np.float32)
    x[0, :8] = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 100.0, -100.0, 0.0], dtype=np.float32)  # ties, saturation
    n_params = (x.shape[axis] + block - 1) // block if block else x.shape[axis]
    shape = [x.shape[0], n_params] if block and axis == 1 else [n_params, x.shape[1]] if block else [n_params]
    scale = rng.uniform(0.05, 0.5, shape).astype(np.float32)
    scale[..., 0] = 1.0  # x[0, :8] / 1 keeps the ties
    if not block and not with_zero and elem == TensorProto.UINT8:
        scale = np.array(1.0, dtype=np.float32)  # per-tensor
    signed = elem in (TensorProto.INT4, TensorProto.INT8)
    zero = rng.integers(-3 if signed else 0, 4, scale.shape) if with_zero else None
    model = _q_model(x, scale, zero, elem, axis, block)
    a = rng.standard_normal(x.shape).astype(np.float32)
    want = _session(model.SerializeToString(), literal=True).run(None, {"a": a})[0]
    report = fold_weight_qdq(model)
    assert report.folded == 1 and [n.op_type for n in model.graph.node] == ["DequantizeLinear", "Mul"]
    assert {t.name for t in model.graph.initializer} >= {"s"} and "w" not in {t.name for t in model.graph.initializer}
    onnx.checker.check_model(model, full_check=True)
    got = _session(model.SerializeToString(), literal=True).run(None, {"a": a})[0]
    np.testing.assert_array_equal(got, want)
    expected_bytes = x.size // 2 if elem in (TensorProto.INT4, TensorProto.UINT4) else x.size * (2 if elem ==
                                                                                                TensorProto.UINT16 else 1)
    assert report.integer_bytes == expected_bytes and report.float_bytes == x.nbytes
    folded = numpy_helper.to_array(model.graph.initializer[-1]).astype(np.int64)
    np.testing.assert_array_equal(folded, quantize_linear(x, scale, zero, elem, axis, block))


def test_float_weights_on_request(tmp_path: Path) -> None:
    q = nqnn.quantize_model(_mlp(64), nqnn.ModelQuantConfig.w4a16(group_size=16))
    x = torch.randn(3, 64)
    folded = nqnn.export_onnx(q, x, tmp_path / "int.onnx")
    unfolded = nqnn.export_onnx(q, x, tmp_path / "float.onnx", integer_weights=False)
    dq_types, q_nodes = _types(onnx.load(unfolded))
    assert len(q_nodes) == 3 and not dq_types  # float weight -> QuantizeLinear -> DequantizeLinear
    def payload(path: Path) -> int:
        return sum(len(t.raw_data) for t in onnx.load(path).graph.initializer)

    assert payload(folded) < 0.22 * payload(unfolded)  # int4 codes + a float scale and int4 zero per 16 weights
    np.testing.assert_array_equal(_run(unfolded, x, True), _run(folded, x, True))


@pytest.mark.parametrize("elem", [TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2])
def test_fp8_fold_is_exact_against_onnxruntime(elem: int) -> None:
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((16, 32)) * 50).astype(np.float32)
    x[0, :4] = [1e6, -1e6, 0.0, 1e-9]  # saturation to +-max, zero, underflow
    scale = rng.uniform(0.05, 0.5, 16).astype(np.float32)
    model = _q_model(x, scale, np.zeros(16), elem, 0, 0)
    a = rng.standard_normal(x.shape).astype(np.float32)
    want = _session(model.SerializeToString(), literal=True).run(None, {"a": a})[0]
    report = fold_weight_qdq(model)
    assert report.folded == 1 and report.integer_bytes == x.size
    assert model.graph.initializer[-1].data_type == elem
    onnx.checker.check_model(model, full_check=True)
    np.testing.assert_array_equal(_session(model.SerializeToString(), literal=True).run(None, {"a": a})[0], want)


def test_q_read_by_another_op_or_a_graph_output_is_kept() -> None:
    x = np.linspace(-1, 1, 32, dtype=np.float32).reshape(4, 8)
    model = _q_model(x, np.array(0.1, dtype=np.float32), None, TensorProto.UINT8, 1, 0)
    model.graph.output.append(helper.make_tensor_value_info("q", TensorProto.UINT8, [4, 8]))
    assert fold_weight_qdq(model).folded == 0
    assert [n.op_type for n in model.graph.node] == ["QuantizeLinear", "DequantizeLinear", "Mul"]


@pytest.mark.parametrize("form", ["transpose_matmul", "gemm_bias"])
def test_blocked_weights_are_reoriented_for_engines_with_the_same_outputs(form: str) -> None:
    """W [N, K] blocked along axis 1 read through Transpose -> MatMul or Gemm(transB=1) becomes W^T [K, N] blocked
    along axis 0 -> MatMul (+ Add): onnxruntime, running the graph as written, gives bit-identical outputs."""
    rng = np.random.default_rng(4)
    n, k, block = 24, 48, 16
    inits = [integer_tensor("q", rng.integers(-8, 8, (n, k)), TensorProto.INT4),
             numpy_helper.from_array(rng.uniform(0.01, 0.1, (n, k // block)).astype(np.float32), "s"),
             integer_tensor("z", rng.integers(-2, 3, (n, k // block)), TensorProto.INT4),
             numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "b")]
    nodes = [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["w"], axis=1, block_size=block)]
    if form == "gemm_bias":
        nodes.append(helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc", transB=1))
        x_shape = [3, k]
    else:
        nodes += [helper.make_node("Transpose", ["w"], ["wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "wt"], ["y"])]
        x_shape = [2, 3, k]
        inits.pop()
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, x_shape[:-1] + [n])], inits,
                              value_info=[helper.make_tensor_value_info("w", TensorProto.FLOAT, [n, k])])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 21)], ir_version=10)
    x = rng.standard_normal(x_shape).astype(np.float32)
    want = _session(model.SerializeToString(), literal=True).run(None, {"x": x})[0]
    assert reorient_blocked_weights(model) == 1
    ops = [nd.op_type for nd in model.graph.node]
    assert ops == (["DequantizeLinear", "MatMul", "Add"] if form == "gemm_bias" else ["DequantizeLinear", "MatMul"])
    by_name = {t.name: t for t in model.graph.initializer}
    dq = model.graph.node[0]
    assert [list(by_name[i].dims) for i in dq.input] == [[k, n], [k // block, n], [k // block, n]]
    assert not {"q", "s", "z"} & set(by_name) and not model.graph.value_info  # stale [N, K] shape dropped
    onnx.checker.check_model(model, full_check=True)
    np.testing.assert_array_equal(_session(model.SerializeToString(), literal=True).run(None, {"x": x})[0], want)
