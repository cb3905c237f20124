"""A user-defined platform, registered in a few lines, works end to end: quantize -> run -> export."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import netquant
from netquant.core.spec import Granularity, QuantSpec, RoundingPolicy
from netquant.core.tensor_config import QuantState
from netquant.platforms import Platform, get_platform, list_platforms, register_platform, unregister_platform
from tests.helpers.ir import make_model
from tests.helpers.onnx_models import calib_batches, residual_concat

HOOKED: list[str] = []


def seven_bit_adds(op_config, graph) -> None:
    """Per-op hook: this NPU's adder takes 7-bit inputs."""
    HOOKED.append(op_config.op.name)
    if op_config.op.op_type == "Add":
        for cfg in op_config.inputs:
            if cfg is not None and cfg.state is QuantState.INITIAL:
                cfg.spec = cfg.spec.with_(bits=7)


@pytest.fixture
def my_npu():
    platform = register_platform(Platform.create(
        "my_npu",
        quantizable=["Conv", "Add", "Concat", "Sigmoid"],
        activation=QuantSpec.int8(),
        weight=QuantSpec.int8_per_channel(axis=0),
        rounding=RoundingPolicy.ROUND_HALF_UP,
        activation_observer="percentile",
        op_hook=seven_bit_adds,
        description="test NPU",
    ))
    yield platform
    unregister_platform("my_npu")


def test_custom_platform_end_to_end(my_npu, tmp_path):
    assert "my_npu" in list_platforms() and get_platform("my_npu") is my_npu
    HOOKED.clear()
    qm = netquant.quantize_onnx(residual_concat(), calib_batches((2, 3, 8, 8), 4), platform="my_npu", quiet=True)
    assert qm.platform is my_npu
    assert set(qm.quantized_ops()) == {"conv1", "conv2", "add", "sigmoid", "concat", "conv3"}
    assert "add" in HOOKED and "conv1" in HOOKED
    # the user's rounding policy and specs are in every config; the hook changed Add's inputs to 7 bits
    for cfg in qm.qgraph.configs():
        if cfg.state is not QuantState.FP32:
            assert cfg.spec.rounding is RoundingPolicy.ROUND_HALF_UP
    w = qm.qgraph.op_configs["conv1"].weight_config()
    assert w.spec.granularity is Granularity.PER_CHANNEL and w.params.scale.shape == (16,)
    # Add's inputs are OVERLAPPED by the producers' int8 outputs: the hook only affects its own quantizers
    # Concat on Platform.create's standard rule shares one scale over its inputs and output
    concat = qm.qgraph.op_configs["concat"]
    scales = {float(c.effective_params.scale) for c in [*concat.inputs, *concat.outputs]}
    assert len(scales) == 1

    x = calib_batches((2, 3, 8, 8), 1, seed=11)[0]
    y_fq = qm.run({"x": x})["y"].numpy()
    y_fp = qm.run({"x": x}, fake_quant=False)["y"].numpy()
    cos = float((y_fq * y_fp).sum() / np.linalg.norm(y_fq) / np.linalg.norm(y_fp))
    assert 0.99 < cos < 1.0

    out = tmp_path / "my_npu.onnx"
    report = qm.export(out)
    assert report.validated and out.exists()
    y_ort = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    cos_ort = float((y_ort * y_fq).sum() / np.linalg.norm(y_ort) / np.linalg.norm(y_fq))
    assert cos_ort >= 0.999  # onnxruntime rounds half-even where we round half-up: ties differ only


def test_hook_changing_spec_is_used_in_calibration(my_npu):
    """The hook makes Add's own input quantizers 7-bit: scale = amax / ((63 + 64) / 2)."""
    add = helper.make_node("Add", ["x1", "x2"], ["y"], name="add")
    graph = helper.make_graph([add], "adder", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4])
                                                for n in ("x1", "x2")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    x1 = np.array([[0.5, -2.0, 1.0, 0.25]], np.float32)
    x2 = np.array([[3.0, 1.0, -1.0, 0.0]], np.float32)
    qm = netquant.quantize_onnx(model, [{"x1": x1, "x2": x2}], platform="my_npu", quiet=True,
                                activation_observer="minmax")
    cfg1, cfg2 = qm.qgraph.op_configs["add"].inputs
    assert cfg1.spec.bits == 7 and (cfg1.spec.qmin, cfg1.spec.qmax) == (-64, 63)
    assert float(cfg1.params.scale) == pytest.approx(2.0 / 63.5, rel=1e-6)
    assert float(cfg2.params.scale) == pytest.approx(3.0 / 63.5, rel=1e-6)
    y = qm.run({"x1": x1, "x2": x2})["y"]
    s1, s2 = 2.0 / 63.5, 3.0 / 63.5
    def q(v, s, lo, hi):  # round half up, clamp, dequantize
        return np.clip(np.floor(v / s + 0.5), lo, hi) * s

    expected = q(x1, s1, -64, 63) + q(x2, s2, -64, 63)
    out_cfg = qm.qgraph.op_configs["add"].outputs[0]
    assert out_cfg.spec.bits == 8  # the hook left the output alone
    np.testing.assert_allclose(y.numpy(), q(expected, float(out_cfg.params.scale), -128, 127), rtol=1e-5, atol=1e-6)
