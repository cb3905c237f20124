"""Built-in platforms: registry, schemes, and the configs each builds for small synthetic models."""

from __future__ import annotations

import pytest

from netquant.core.spec import Granularity, QuantFormat, QuantSpec, RoundingPolicy, ScaleConstraint
from netquant.core.tensor_config import QuantState
from netquant.errors import ConfigError
from netquant.graph import load_onnx
from netquant.passes import build_quant_graph
from netquant.platforms import (
    BUILTIN_PLATFORMS,
    Platform,
    get_platform,
    list_platforms,
    register_platform,
    unregister_platform,
)
from tests.helpers.ir import make_model
from tests.helpers.onnx_models import conv_relu_gemm, matmul_model, residual_concat

BUILTIN_NAMES = ["onnxruntime_int8", "tensorrt_int8", "openvino_int8", "tflite_int8", "ncnn_int8", "qnn_dsp",
                 "academic_int8", "academic_int4", "pow2_int8", "fp8_e4m3"]


def build(model, platform):
    return build_quant_graph(load_onnx(model), get_platform(platform))


def test_all_builtins_registered():
    assert set(BUILTIN_NAMES) <= set(list_platforms())
    assert len(BUILTIN_PLATFORMS) == len(BUILTIN_NAMES)
    for name in BUILTIN_NAMES:
        p = get_platform(name)
        assert p.name == name and p.description and p.scheme()


def test_unknown_platform_lists_valid_ones():
    with pytest.raises(ConfigError) as err:
        get_platform("tensorflow_int3")
    msg = str(err.value)
    assert "tensorflow_int3" in msg
    for name in BUILTIN_NAMES:
        assert name in msg


def test_aliases_and_case():
    assert get_platform("ONNXRuntime") is get_platform("onnxruntime_int8")
    assert get_platform("TensorRT-INT8") is get_platform("tensorrt_int8")
    assert get_platform("snpe") is get_platform("qnn_dsp")


def test_duplicate_registration_needs_overwrite():
    p = Platform.create("dup_test_platform", ["Conv"])
    register_platform(p)
    try:
        with pytest.raises(ConfigError, match="already registered"):
            register_platform(Platform.create("dup_test_platform", ["Gemm"]))
        q = register_platform(Platform.create("dup_test_platform", ["Gemm"]), overwrite=True)
        assert get_platform("dup_test_platform") is q
    finally:
        unregister_platform("dup_test_platform")


def test_create_rejects_unknown_op_type():
    with pytest.raises(ConfigError, match="no standard quantization rule for op type 'FancyOp'"):
        Platform.create("bad", ["Conv", "FancyOp"])


def test_schemes_match_the_engines():
    ort = get_platform("onnxruntime_int8")
    assert (ort.activation.signed, ort.activation.symmetric) == (False, False)  # uint8 affine
    assert ort.weight.signed and ort.weight.symmetric and ort.weight.granularity is Granularity.PER_CHANNEL
    assert ort.bias is not None and ort.bias.bits == 32
    trt = get_platform("tensorrt_int8")
    assert trt.activation.symmetric and trt.activation.signed and trt.activation.qmin == -127
    assert get_platform("ncnn_int8").weight.rounding is RoundingPolicy.ROUND_HALF_FAR_FROM_ZERO
    assert get_platform("pow2_int8").activation.scale_constraint is ScaleConstraint.POWER_OF_TWO
    assert get_platform("fp8_e4m3").activation.fmt is QuantFormat.FP8_E4M3
    qnn = get_platform("qnn_dsp")  # QNN HTP: uint8 affine activations, int8 symmetric per-channel weights
    assert not qnn.activation.signed and qnn.weight.signed and qnn.weight.symmetric
    assert qnn.weight.granularity is Granularity.PER_CHANNEL
    a4 = get_platform("academic_int4")
    assert a4.activation.qmax == 15 and a4.weight.qmin == -8
    tfl = get_platform("tflite_int8")
    assert tfl.activation.signed and not tfl.activation.symmetric and tfl.weight.qmin == -128


def _states(qg, node):
    oc = qg.op_configs[node]
    return ([c.state if c is not None else None for c in oc.inputs],
            [c.state if c is not None else None for c in oc.outputs])


def test_onnxruntime_configs_conv_relu_gemm():
    qg = build(conv_relu_gemm(), "onnxruntime_int8")
    conv = qg.op_configs["conv"]
    x_cfg, w_cfg, b_cfg = conv.inputs
    assert x_cfg.state is QuantState.INITIAL and not x_cfg.spec.signed  # graph input: own uint8 quantizer
    assert w_cfg.spec.granularity is Granularity.PER_CHANNEL and w_cfg.spec.axis == 0
    assert b_cfg.state is QuantState.PASSIVE_INIT and b_cfg.spec.bits == 32
    # fusion Conv -> Relu: one quantizer after the Relu (ORT removes the Relu before Q)
    relu_out = qg.op_configs["relu"].outputs[0]
    assert conv.outputs[0].state is QuantState.OVERLAPPED and conv.outputs[0].dominated_by is relu_out
    assert qg.op_configs["relu"].inputs[0].state is QuantState.OVERLAPPED
    # MaxPool and Reshape run on integers: their outputs share the Relu output's params
    pool_out = qg.op_configs["pool"].outputs[0]
    assert pool_out.state is QuantState.PASSIVE_INIT and pool_out.root is relu_out
    assert qg.op_configs["flatten"].outputs[0].root is relu_out
    assert qg.op_configs["flatten"].inputs[1] is None  # int64 shape input: never quantized
    # Gemm(transB=1): weight (N, K) per-channel on axis 0; float output (QGemm with float output)
    fc = qg.op_configs["fc"]
    assert fc.inputs[1].spec.axis == 0
    assert fc.inputs[0].state is QuantState.OVERLAPPED
    assert fc.outputs[0].state is QuantState.FP32


def test_onnxruntime_keeps_elementwise_ops_float():
    qg = build(residual_concat(), "onnxruntime_int8")
    for name in ("add", "sigmoid"):
        ins, outs = _states(qg, name)
        assert set(ins) | set(outs) == {QuantState.FP32} or all(
            s in (QuantState.FP32, QuantState.OVERLAPPED) for s in ins) and outs == [QuantState.FP32]
    # conv outputs are quantized (QLinearConv writes uint8)
    assert qg.op_configs["conv1"].outputs[0].state is QuantState.INITIAL
    # Concat's inputs are not all quantized upstream (Sigmoid is float): it stays float
    assert _states(qg, "concat")[1] == [QuantState.FP32]


def test_onnxruntime_matmul_only_with_weights():
    qg = build(matmul_model(), "onnxruntime_int8")
    proj = qg.op_configs["proj"]
    assert proj.roles == {0: "activation", 1: "weight"}
    assert proj.inputs[1].spec.axis == 1  # (K, N) weight: output channels on axis 1
    assert proj.outputs[0].state is QuantState.FP32  # MatMulIntegerToFloat: float output
    assert not qg.op_configs["attn"].is_quantized  # activation x activation: not an ORT int8 kernel


def test_tensorrt_quantizes_inputs_and_shares_concat_scale():
    qg = build(residual_concat(), "tensorrt_int8")
    assert not qg.op_configs["add"].is_quantized  # element-wise adds run in higher precision (builtin.py)
    assert qg.op_configs["conv2"].inputs[0].state is not QuantState.FP32  # conv inputs are quantized
    assert qg.op_configs["conv3"].outputs[0].state is QuantState.FP32  # graph output: no consumer quantizes
    groups = qg.shared_scale_groups
    assert len(groups) == 1 and len(groups[0]) == 3  # Concat: its two inputs and its output
    assert qg.op_configs["conv1"].inputs[2].state is QuantState.FP32  # TensorRT keeps bias float


def test_tflite_quantizes_heavy_ops_and_keeps_elementwise_float():
    qg = build(residual_concat(), "tflite_int8")
    for node in ("conv1", "conv2", "conv3"):
        assert qg.op_configs[node].outputs[0].state is QuantState.INITIAL
    for node in ("add", "sigmoid", "concat"):  # Sigmoid / Concat run int8 only on int8 inputs
        assert not qg.op_configs[node].is_quantized
    assert qg.op_configs["conv3"].inputs[0].state is QuantState.INITIAL  # its own quantizer on the float Concat


def test_academic_quantizes_only_compute_inputs():
    qg = build(conv_relu_gemm(), "academic_int8")
    assert [c.state for c in qg.op_configs["conv"].outputs] == [QuantState.FP32]
    assert qg.op_configs["conv"].inputs[1].spec.granularity is Granularity.PER_CHANNEL  # see builtin.py
    assert not qg.op_configs["pool"].is_quantized and not qg.op_configs["relu"].is_quantized
    assert get_platform("academic_int8").bias_correction


def test_academic_quantizes_conv_gemm_not_matmul():
    """PPQ's ACADEMIC quant_operation_types are Conv, Gemm and ConvTranspose: MatMul stays float."""
    qg = build(matmul_model(), "academic_int8")
    assert not qg.op_configs["proj"].is_quantized and not qg.op_configs["attn"].is_quantized
    assert sorted(get_platform("academic_int4").rules) == ["Conv", "ConvTranspose", "Gemm"]


_PC0 = {"granularity": Granularity.PER_CHANNEL, "axis": 0}
# The Conv weight spec each engine documents (qmin, qmax follow from bits/signed/narrow_range).
CONV_WEIGHT_SPECS = {
    # pair-limited int8 weights ('any' CPU target) keep the full int8 code range [-128, 127]
    "onnxruntime_int8": (QuantSpec(bits=8, signed=True, symmetric=True, **_PC0), -128, 127),
    "tensorrt_int8": (QuantSpec(bits=8, signed=True, symmetric=True, narrow_range=True, **_PC0), -127, 127),
    "openvino_int8": (QuantSpec(bits=8, signed=True, symmetric=True, narrow_range=True, **_PC0), -127, 127),
    # full-range scales (amax / 127.5); the .tflite writer stores the codes in TFLite's [-127, 127]
    "tflite_int8": (QuantSpec(bits=8, signed=True, symmetric=True, **_PC0), -128, 127),
    "ncnn_int8": (QuantSpec(bits=8, signed=True, symmetric=True, narrow_range=True,
                            rounding=RoundingPolicy.ROUND_HALF_FAR_FROM_ZERO, **_PC0), -127, 127),
    "qnn_dsp": (QuantSpec(bits=8, signed=True, symmetric=True, **_PC0), -128, 127),
    "academic_int8": (QuantSpec(bits=8, signed=True, symmetric=True, **_PC0), -128, 127),
    "academic_int4": (QuantSpec(bits=4, signed=True, symmetric=True, **_PC0), -8, 7),
    # half to even: the rounding of the QDQ file's QuantizeLinear (builtin.py)
    "pow2_int8": (QuantSpec(bits=8, signed=True, symmetric=True, scale_constraint=ScaleConstraint.POWER_OF_TWO,
                            **_PC0), -128, 127),
    "fp8_e4m3": (QuantSpec(bits=8, signed=True, symmetric=True, fmt=QuantFormat.FP8_E4M3, **_PC0), None, None),
}


def test_conv_weight_spec_table_covers_every_builtin():
    assert sorted(CONV_WEIGHT_SPECS) == sorted(BUILTIN_NAMES)


@pytest.mark.parametrize("name", BUILTIN_NAMES)
def test_every_platform_builds_and_quantizes_the_conv(name):
    qg = build(conv_relu_gemm(), name)
    assert "conv" in qg.quantized_ops()
    w = qg.op_configs["conv"].weight_config()
    spec, qmin, qmax = CONV_WEIGHT_SPECS[name]
    assert w is not None and w.spec == spec
    if qmin is not None:
        assert (w.spec.qmin, w.spec.qmax) == (qmin, qmax)


def _depthwise_model(after_relu: bool):
    """x -> Conv(3x3, 16) -> [Relu | Sigmoid] -> depthwise Conv(3x3, group=16) -> y."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(16, 3, 3, 3)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.normal(size=(16, 1, 3, 3)).astype(np.float32), "Wd")]
    nodes = [helper.make_node("Conv", ["x", "W1"], ["a"], name="pw", pads=[1, 1, 1, 1]),
             helper.make_node("Relu" if after_relu else "Sigmoid", ["a"], ["r"], name="act"),
             helper.make_node("Conv", ["r", "Wd"], ["y"], name="dw", group=16, pads=[1, 1, 1, 1])]
    graph = helper.make_graph(nodes, "dw", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 6, 6])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 16, 6, 6])], inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def test_onnxruntime_depthwise_conv_only_on_an_integer_chain():
    """Depthwise convs are memory-bound: int8 only pays when the input is already quantized."""
    assert "dw" in build(_depthwise_model(after_relu=True), "onnxruntime_int8").quantized_ops()
    assert "dw" not in build(_depthwise_model(after_relu=False), "onnxruntime_int8").quantized_ops()
    assert "dw" in build(_depthwise_model(after_relu=False), "tensorrt_int8").quantized_ops()


def test_onnxruntime_skips_tiny_convs():
    """Convs under ORT_MIN_CONV_MACS multiply-adds per pixel stay float unless fed integers."""
    from netquant.platforms.builtin import ORT_MIN_CONV_MACS

    model = _depthwise_model(after_relu=True)
    small = numpy_helper_array((2, 3, 3, 3))
    assert small.size < ORT_MIN_CONV_MACS
    model.graph.initializer[0].CopyFrom(small_proto(small, "W1"))
    model.graph.initializer[1].CopyFrom(small_proto(numpy_helper_array((2, 1, 3, 3)), "Wd"))
    model.graph.node[2].attribute[0].i = 2  # group = 2 channels now
    qg = build(model, "onnxruntime_int8")
    assert qg.quantized_ops() == []


def numpy_helper_array(shape):
    import numpy as np

    return np.random.default_rng(1).normal(size=shape).astype(np.float32)


def small_proto(arr, name):
    from onnx import numpy_helper

    return numpy_helper.from_array(arr, name)


def test_wider_formats_are_declared_where_the_engine_runs_them():
    """qnn_dsp falls back to uint16 activations with its int8 weights (QNN HTP A16W8), academic_int4 to 8-bit
    activations and weights; every other preset has no wider format (INT8-or-float placement, as before)."""
    from netquant.platforms import BUILTIN_PLATFORMS, WiderFormat

    with_wider = {p.name for p in BUILTIN_PLATFORMS if p.wider is not None}
    assert with_wider == {"qnn_dsp", "academic_int4"}
    qnn = get_platform("qnn_dsp").widened()
    assert (qnn.activation.bits, qnn.activation.signed, qnn.activation.symmetric) == (16, False, False)
    assert (qnn.activation.qmin, qnn.activation.qmax) == (0, 65535)
    assert qnn.weight == get_platform("qnn_dsp").weight and qnn.wider is None
    a4 = get_platform("academic_int4").widened()
    assert (a4.activation.bits, a4.weight.bits, a4.weight.granularity) == (8, 8, Granularity.PER_CHANNEL)
    assert "wider fallback uint16 activations (A16W8)" in get_platform("qnn_dsp").scheme()
    with pytest.raises(ConfigError, match="no wider format"):
        get_platform("onnxruntime_int8").widened()
    with pytest.raises(ConfigError, match="integer format"):
        WiderFormat(QuantSpec(fmt=QuantFormat.FP8_E4M3))
    assert WiderFormat(QuantSpec(bits=16, signed=True)).label == "int16 activations"
