"""The quantizer and its passes: weights in Constant nodes, overrides, alignment, bias, bad data."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

import netquant
from netquant.core.spec import Granularity, QuantSpec
from netquant.core.tensor_config import QuantState
from netquant.errors import CalibrationError, ConfigError, DataError, UnsupportedOpError
from netquant.graph import load_onnx
from netquant.passes import OpSelector, Override, QuantizerWarning, build_quant_graph
from netquant.platforms import get_platform
from tests.helpers.ir import make_model
from tests.helpers.onnx_models import (
    calib_batches,
    conv_relu_gemm,
    dynamic_weight_conv,
    residual_concat,
)

ORT = "onnxruntime_int8"


def quantize(model, platform=ORT, n=4, shape=(2, 3, 8, 8), **kw):
    return netquant.quantize_onnx(model, calib_batches(shape, n), platform=platform, quiet=True, **kw)


# ---- weights ------------------------------------------------------------------------------------

def test_weights_in_constant_nodes_are_weights_without_cleanup():
    graph = load_onnx(conv_relu_gemm(weights_as_constants=True))
    assert not graph.initializers.keys() & {"W", "B", "W2", "B2"}
    qg = build_quant_graph(graph, get_platform(ORT))
    conv = qg.op_configs["conv"]
    assert conv.roles == {0: "activation", 1: "weight", 2: "bias"}
    assert conv.inputs[1].spec.granularity is Granularity.PER_CHANNEL
    assert qg.op_configs["fc"].roles[1] == "weight"


def test_constant_node_weights_give_the_same_model_as_initializers():
    a = quantize(conv_relu_gemm(weights_as_constants=False))
    b = quantize(conv_relu_gemm(weights_as_constants=True))
    wa, wb = a.qgraph.op_configs["conv"].weight_config(), b.qgraph.op_configs["conv"].weight_config()
    assert torch.equal(wa.params.scale, wb.params.scale)
    x = calib_batches((2, 3, 8, 8), 1, seed=9)[0]
    assert torch.equal(a.run({"x": x})["y"], b.run({"x": x})["y"])


def test_per_channel_weight_scales_are_minmax_per_output_channel():
    qm = quantize(conv_relu_gemm(), target="x86-vnni")  # full-range int8 weights
    w = qm.qgraph.graph.initializers[qm.qgraph.op_configs["conv"].op.inputs[1]]
    scale = qm.qgraph.op_configs["conv"].weight_config().params.scale
    expected = w.abs().amax(dim=(1, 2, 3)) / 127.5  # symmetric int8: amax / ((qmax - qmin) / 2)
    torch.testing.assert_close(scale, expected, rtol=1e-6, atol=0)


# ---- observers against torch.ao --------------------------------------------------------------------

def test_activation_params_match_torch_minmax_observer():
    batches = calib_batches((2, 3, 8, 8), 3)
    qm = netquant.quantize_onnx(conv_relu_gemm(), batches, platform=ORT, quiet=True, activation_observer="minmax",
                                range_bits=None)
    obs = torch.ao.quantization.MinMaxObserver(dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    for b in batches:
        obs(torch.from_numpy(b))
    scale, zp = obs.calculate_qparams()
    p = qm.qgraph.op_configs["conv"].inputs[0].params
    torch.testing.assert_close(p.scale.reshape(1), scale.float(), rtol=1e-6, atol=0)
    assert int(p.zero_point) == int(zp)


# ---- bias ----------------------------------------------------------------------------------------

def test_bias_is_int32_with_scale_input_times_weight():
    qm = quantize(conv_relu_gemm())
    for name in ("conv", "fc"):
        oc = qm.qgraph.op_configs[name]
        b = oc.bias_config()
        assert b.state is QuantState.PASSIVE and b.spec.bits == 32
        s_in = oc.inputs[0].effective_params.scale
        s_w = oc.weight_config().params.scale
        torch.testing.assert_close(b.params.scale, s_in * s_w, rtol=0, atol=0)
        assert int(b.params.zero_point.abs().max()) == 0
        assert b.params.scale.shape == s_w.shape  # per-channel bias follows the per-channel weight


# ---- fusion and shared scales ------------------------------------------------------------------

def test_shared_scale_group_is_aligned_after_calibration():
    qm = quantize(residual_concat(), platform="tensorrt_int8")
    qg = qm.qgraph
    concat = qg.op_configs["concat"]
    params = [c.effective_params for c in [*concat.inputs, *concat.outputs]]
    for p in params[1:]:
        assert torch.equal(p.scale, params[0].scale) and torch.equal(p.zero_point, params[0].zero_point)
    # the shared scale covers every member: at least the largest |value| seen by the KL observers
    assert qg.aligned_groups == 1


def test_relu_fused_output_has_no_negative_range():
    qm = quantize(conv_relu_gemm(), activation_observer="minmax")
    relu_out = qm.qgraph.op_configs["relu"].outputs[0].params
    assert int(relu_out.zero_point) == 0  # uint8 with min 0: ORT drops the Relu in front of Q
    assert qm.qgraph.op_configs["conv"].outputs[0].effective_params is relu_out


# ---- overrides -------------------------------------------------------------------------------------

@pytest.mark.parametrize("selector", ["conv", "Conv", "name:conv", "type:Conv", "glob:co*", "re:^con"])
def test_force_fp32(selector):
    qm = quantize(conv_relu_gemm(), force_fp32=[selector])
    assert "conv" not in qm.quantized_ops()
    conv = qm.qgraph.op_configs["conv"]
    assert all(c is None or c.state is QuantState.FP32 for c in conv.configs())
    assert "fc" in qm.quantized_ops()  # the rest is still quantized


def test_force_fp32_selector_matching_nothing_is_an_error():
    with pytest.raises(ConfigError, match="matches no op"):
        quantize(conv_relu_gemm(), force_fp32=["name:does_not_exist"])


def test_override_changes_specs_by_op_type():
    int4 = QuantSpec(bits=4, signed=True, symmetric=True)
    act16 = QuantSpec(bits=16, signed=False, symmetric=False)
    qm = quantize(conv_relu_gemm(), overrides=[Override(OpSelector(op_type="Gemm"), weight=int4, activation=act16)])
    fc = qm.qgraph.op_configs["fc"]
    assert fc.weight_config().spec == int4
    w = qm.qgraph.graph.initializers["W2"]
    assert float(fc.weight_config().params.scale) == pytest.approx(float(w.abs().max()) / 7.5, rel=1e-6)  # amax / ((7 + 8) / 2)
    conv = qm.qgraph.op_configs["conv"]
    assert conv.weight_config().spec.bits == 8  # other ops keep the platform's spec


def test_per_tensor_setting():
    qm = quantize(conv_relu_gemm(), per_channel=False)
    assert qm.qgraph.op_configs["conv"].weight_config().params.scale.dim() == 0


# ---- unsupported ops ----------------------------------------------------------------------------------

def test_unsupported_op_stays_fp32_with_warning_and_strict_raises():
    model = dynamic_weight_conv()
    batch = [{"x": np.ones((1, 2, 5, 5), np.float32), "w": np.ones((3, 2, 3, 3), np.float32)}]
    with pytest.warns(QuantizerWarning, match="Conv node 'dynconv' stays FP32 .* not a constant"):
        qm = netquant.quantize_onnx(model, batch, platform=ORT, quiet=True)
    assert qm.quantized_ops() == [] and len(qm.warnings) == 1
    with pytest.raises(UnsupportedOpError, match="dynconv"):
        netquant.quantize_onnx(model, batch, platform=ORT, quiet=True, strict=True)


def test_custom_domain_op_stays_fp32():
    graph = load_onnx(conv_relu_gemm())
    graph.node("conv").domain = "com.example"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qg = build_quant_graph(graph, get_platform(ORT))
    assert "conv" not in qg.quantized_ops()
    assert any("com.example" in str(w.message) for w in caught)


# ---- calibration data errors --------------------------------------------------------------------------

def test_calibration_data_wrong_shape_names_input_and_expected_shape():
    bad = [np.zeros((2, 3, 9, 8), np.float32)]
    with pytest.raises(DataError, match=r"input 'x' has shape \[2, 3, 9, 8\], the model expects \[N, 3, 8, 8\]"):
        netquant.quantize_onnx(conv_relu_gemm(), bad, quiet=True)
    with pytest.raises(DataError, match=r"'x'.*expects \[N, 3, 8, 8\] \(4-d\)"):
        netquant.quantize_onnx(conv_relu_gemm(), [np.zeros((3, 8, 8), np.float32)], quiet=True)


def test_calibration_data_wrong_dtype():
    with pytest.raises(DataError, match=r"input 'x' has dtype float64, the model expects float32 with shape "
                                        r"\[N, 3, 8, 8\]"):
        netquant.quantize_onnx(conv_relu_gemm(), [np.zeros((1, 3, 8, 8))], quiet=True)


def test_calibration_data_wrong_count():
    x = np.zeros((1, 3, 8, 8), np.float32)
    with pytest.raises(DataError, match=r"got 2 arrays but the model takes 1 inputs: 'x' \[N, 3, 8, 8\]"):
        netquant.quantize_onnx(conv_relu_gemm(), [(x, x)], quiet=True)
    with pytest.raises(DataError, match=r"missing \['x'\]"):
        netquant.quantize_onnx(conv_relu_gemm(), [{"input": x}], quiet=True)
    with pytest.raises(CalibrationError, match="empty"):
        netquant.quantize_onnx(conv_relu_gemm(), [], quiet=True)


def test_calibration_data_nan():
    x = np.zeros((1, 3, 8, 8), np.float32)
    x[0, 0, 0, 0] = np.nan
    with pytest.raises(DataError, match="'x' contains NaN"):
        netquant.quantize_onnx(conv_relu_gemm(), [x], quiet=True)


def test_stacked_array_is_split_into_batches():
    data = np.random.default_rng(0).normal(size=(10, 3, 8, 8)).astype(np.float32)
    qm = netquant.quantize_onnx(conv_relu_gemm(), data, quiet=True, batch_size=4)
    whole = netquant.quantize_onnx(conv_relu_gemm(), [data[:4], data[4:8], data[8:]], quiet=True)
    a = qm.qgraph.op_configs["conv"].inputs[0].params
    b = whole.qgraph.op_configs["conv"].inputs[0].params
    assert torch.equal(a.scale, b.scale)


def test_unknown_setting_lists_valid_ones():
    with pytest.raises(ConfigError, match="unknown setting.*'observer'.*valid settings: .*activation_observer"):
        netquant.quantize_onnx(conv_relu_gemm(), calib_batches((1, 3, 8, 8), 1), observer="kl")
    with pytest.raises(ConfigError, match="not a known observer"):
        netquant.quantize_onnx(conv_relu_gemm(), calib_batches((1, 3, 8, 8), 1), activation_observer="best")


def test_malformed_opset_model_message_names_file(tmp_path):
    bad = tmp_path / "broken.onnx"
    bad.write_bytes(b"not a protobuf")
    with pytest.raises(netquant.ModelError, match="broken.onnx"):
        netquant.quantize_onnx(str(bad), calib_batches((1, 3, 8, 8), 1))


def test_model_without_float_inputs_needs_no_calibration():
    """A graph whose only quantized tensors are weights and derived ones calibrates without running."""
    w = helper.make_tensor("W", TensorProto.FLOAT, [2, 2], [1.0, 2.0, 3.0, 4.0])
    node = helper.make_node("Gemm", ["x", "W"], ["y"], name="g")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2])], [w])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    onnx.checker.check_model(model)
    qm = netquant.quantize_onnx(model, [np.array([[1.0, -1.0]], np.float32)], quiet=True)
    assert qm.quantized_ops() == ["g"]
