"""Bias correction: the mean output shift of quantization folded into the bias (passes.bias_correction).

The model is the failure seen on the PP-OCR recognizer: a depthwise conv whose input channels sit at a large
mean with little spread, and whose weights are large and sum to ~0 (a BatchNorm-folded edge filter). Reference:
the FP32 model in onnxruntime, and E[conv(x, W_q - W)] computed here with torch in float64.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.passes.bias_correction import correct_biases
from netquant.passes.quant_graph import fake_quant
from tests.helpers.ir import make_model

C, HW = 8, 12


def edge_model() -> onnx.ModelProto:
    """x[N, C, HW, HW] -> depthwise Conv(3x3, pad 1, W, b) -> y; W large with per-channel sums near 0."""
    rng = np.random.default_rng(7)
    w = rng.normal(0, 20.0, (C, 1, 3, 3))
    w -= w.mean(axis=(1, 2, 3), keepdims=True)  # sum 0: a constant input gives the bias only
    b = rng.normal(0, 0.5, (C,))
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="dw", kernel_shape=[3, 3], pads=[1, 1, 1, 1],
                            group=C)
    graph = helper.make_graph(
        [node], "edge", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, HW, HW])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", C, HW, HW])],
        [numpy_helper.from_array(w.astype(np.float32), "w"), numpy_helper.from_array(b.astype(np.float32), "b")])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def inputs(n: int, seed: int) -> np.ndarray:
    """Channels at means -3..3 with spread 0.05: nearly constant, like the recognizer's first stage."""
    rng = np.random.default_rng(seed)
    means = np.linspace(-3.0, 3.0, C).reshape(1, C, 1, 1)
    return (means + rng.normal(0, 0.05, (n, C, HW, HW))).astype(np.float32)


def ort_fp32(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def mean_shift(y: np.ndarray, ref: np.ndarray) -> float:
    """Largest per-channel mean error, over the interior pixels (no padding)."""
    d = (y - ref)[:, :, 1:-1, 1:-1]
    return float(np.abs(d.mean(axis=(0, 2, 3))).max())


@pytest.mark.parametrize("platform", ["academic_int8", "fp8_e4m3"])
def test_bias_correction_removes_the_mean_shift(platform):
    model = edge_model()
    calib = [inputs(4, seed) for seed in range(4)]
    x_eval = inputs(8, 100)
    ref = ort_fp32(model, x_eval)
    plain = netquant.quantize_onnx(model, calib, platform=platform, bias_correction=False, quiet=True)
    fixed = netquant.quantize_onnx(model, calib, platform=platform, bias_correction=True, quiet=True)
    assert not plain.qgraph.bias_corrections and set(fixed.qgraph.bias_corrections) == {"b"}
    before = mean_shift(plain.run({"x": x_eval})["y"].numpy(), ref)
    after = mean_shift(fixed.run({"x": x_eval})["y"].numpy(), ref)
    assert before > 0.05  # the leak the correction exists for
    assert after < before / 5
    # the FP32 run of the corrected model is the original model (onnxruntime's output)
    np.testing.assert_allclose(fixed.run({"x": x_eval}, fake_quant=False)["y"].numpy(), ref, atol=2e-4, rtol=1e-5)


@pytest.mark.parametrize("input_error", [False, True])
def test_correction_is_the_mean_weight_and_input_error(input_error):
    """delta = E[conv(x, W_q) - conv(x, W)] (input_error: E[conv(q(x), W_q) - conv(x, W)]) per channel,
    recomputed here in float64 with torch."""
    model = edge_model()
    calib = [inputs(4, seed) for seed in range(3)]
    qm = netquant.quantize_onnx(model, calib, platform="academic_int8", bias_correction=False, quiet=True)
    qg = qm.qgraph
    oc = qg.op_configs["dw"]
    w = qg.graph.initializers["w"].float()
    w_q = fake_quant(w, oc.inputs[1]).double()
    b0 = qg.graph.initializers["b"].clone()
    got = correct_biases(qg, [{"x": torch.from_numpy(x)} for x in calib], input_error=input_error)["b"]
    expect = torch.zeros(C, dtype=torch.float64)
    for x in calib:
        xt = torch.from_numpy(x)
        xq = fake_quant(xt, oc.inputs[0]).double() if input_error else xt.double()
        y_q = torch.nn.functional.conv2d(xq, w_q, None, 1, 1, 1, C)
        y = torch.nn.functional.conv2d(xt.double(), w.double(), None, 1, 1, 1, C)
        expect += (y_q - y).mean(dim=(0, 2, 3)) / len(calib)
    torch.testing.assert_close(got.delta.double(), expect, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(qg.graph.initializers["b"].double(), b0.double() - expect, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.original, b0)


def test_exported_file_carries_the_corrected_bias(tmp_path):
    model = edge_model()
    calib = [inputs(4, seed) for seed in range(4)]
    qm = netquant.quantize_onnx(model, calib, platform="academic_int8", bias_correction=True, quiet=True)
    path = tmp_path / "dw.onnx"
    qm.export(path)
    x_eval = inputs(8, 100)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    got = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, {"x": x_eval})[0]
    np.testing.assert_allclose(got, qm.run({"x": x_eval})["y"].numpy(), atol=1e-3, rtol=1e-4)
    plain = netquant.quantize_onnx(model, calib, platform="academic_int8", bias_correction=False, quiet=True)
    ref = ort_fp32(model, x_eval)
    assert mean_shift(got, ref) < mean_shift(plain.run({"x": x_eval})["y"].numpy(), ref) / 5


def test_a_floated_op_gets_its_fp32_bias_back(tmp_path):
    """Placement keeping an op in float (its configs FP32): the graph, the fake-quant run and the exported file
    use the FP32 bias again, so the op is exactly the FP32 op."""
    from netquant.core.tensor_config import QuantState

    model = edge_model()
    calib = [inputs(4, seed) for seed in range(4)]
    qm = netquant.quantize_onnx(model, calib, platform="academic_int8", bias_correction=True, quiet=True,
                                objective=None)
    bc = qm.qgraph.bias_corrections["b"]
    assert qm.qgraph.graph.initializers["b"] is bc.corrected
    for cfg in qm.qgraph.op_configs["dw"].configs():
        cfg.state = QuantState.FP32
    assert qm.qgraph.graph.initializers["b"] is bc.original
    x_eval = inputs(8, 100)
    ref = ort_fp32(model, x_eval)
    np.testing.assert_allclose(qm.run({"x": x_eval})["y"].numpy(), ref, atol=2e-4, rtol=1e-5)
    path = tmp_path / "dw_float.onnx"
    qm.export(path, validate=False, allow_float=True)  # its only op is float now: a float file, as asked
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x_eval})[0]
    np.testing.assert_allclose(got, ref, atol=2e-4, rtol=1e-5)
