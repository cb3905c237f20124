"""Exact simplifications (affine folding, hard-swish) and don't-care ranges used by calibration."""

from __future__ import annotations

import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.graph import load_onnx, to_onnx
from netquant.passes.flat_ranges import FlatRanges
from netquant.passes.simplify import fold_conv_affine, hardswish_to_hardsigmoid, simplify
from tests.helpers.ir import make_model

K, C = 1.7, 0.4  # learnable-affine-block scale and shift (PP-LCNet style)


def lcnet_block(residual: bool = False) -> onnx.ModelProto:
    """x -> Conv -> Mul(K) -> Add(C) -> hard-swish as Add(3), Clip(0, 6), Mul, Div(6) -> Conv -> y."""
    rng = np.random.default_rng(5)
    f = np.float32
    inits = [numpy_helper.from_array(rng.normal(0, 0.5, (16, 3, 3, 3)).astype(f), "W"),
             numpy_helper.from_array(rng.normal(0, 0.2, (16,)).astype(f), "B"),
             numpy_helper.from_array(np.array([K], f), "k"), numpy_helper.from_array(np.array(C, f), "c"),
             numpy_helper.from_array(np.array(3.0, f), "three"), numpy_helper.from_array(np.array(0.0, f), "zero"),
             numpy_helper.from_array(np.array(6.0, f), "six"),
             numpy_helper.from_array(rng.normal(0, 0.5, (2, 16, 1, 1)).astype(f), "W2")]
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c0"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Mul", ["k", "c0"], ["m"], name="lab_mul"),
        helper.make_node("Add", ["m", "c"], ["a"], name="lab_add"),
        helper.make_node("Add", ["a", "three"], ["a3"], name="hs_add"),
        helper.make_node("Clip", ["a3", "zero", "six"], ["cl"], name="hs_clip"),
        helper.make_node("Mul", ["a", "cl"], ["hm"], name="hs_mul"),
        helper.make_node("Div", ["hm", "six"], ["h"], name="hs_div"),
        helper.make_node("Conv", ["h", "W2"], ["y"], name="conv2"),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, 8, 8])]
    if residual:  # `a` is also a graph output: its negative values matter
        outputs.append(helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 16, 8, 8]))
    graph = helper.make_graph(nodes, "lcnet_block",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])], outputs, inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def _run(model: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_simplify_is_exact_in_onnxruntime():
    model = lcnet_block()
    graph = load_onnx(model)
    counts = simplify(graph)
    assert counts == {"conv_affine": 2, "hardswish": 1}
    assert [n.op_type for n in graph.nodes] == ["Conv", "HardSigmoid", "Mul", "Conv"]
    x = np.random.default_rng(1).normal(0, 2, (2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(_run(to_onnx(graph), x), _run(model, x), rtol=1e-5, atol=1e-5)


def test_conv_affine_fold_needs_a_per_channel_constant():
    model = lcnet_block()
    model.graph.initializer[2].CopyFrom(numpy_helper.from_array(np.ones((1, 1, 8, 8), np.float32), "k"))
    graph = load_onnx(model)
    assert fold_conv_affine(graph) == 0  # a spatial multiplier is not a per-channel scale
    assert hardswish_to_hardsigmoid(graph) == 1


def test_flat_range_of_conv_output_behind_affine_and_hardswish():
    graph = load_onnx(lcnet_block())
    flat = FlatRanges(graph)
    assert flat.lower_flat("a") == pytest.approx(-3.0)  # hard-swish is 0 for a <= -3
    assert flat.lower_flat("m") == pytest.approx(-3.0 - C)
    assert flat.lower_flat("c0") == pytest.approx((-3.0 - C) / K)
    assert flat.lower_flat("h") == -math.inf  # read by a Conv: every value matters
    assert FlatRanges(load_onnx(lcnet_block(residual=True))).lower_flat("a") == -math.inf


def test_calibration_spends_the_grid_above_the_flat_bound():
    rng = np.random.default_rng(2)
    data = [rng.normal(0, 3, (4, 3, 8, 8)).astype(np.float32) for _ in range(3)]
    kw = {"platform": "onnxruntime_int8", "quiet": True, "activation_observer": "minmax"}
    qm = netquant.quantize_onnx(lcnet_block(), data, **kw)
    plain = netquant.quantize_onnx(lcnet_block(), data, flat_ranges=False, **kw)
    conv_out = qm.qgraph.op_configs["conv"].outputs[0]
    assert conv_out.name == "a"  # after folding, the Conv writes the hard-swish input
    p, q = conv_out.params, plain.qgraph.op_configs["conv"].outputs[0].params
    lowest = float((0 - p.zero_point) * p.scale)  # uint8: value of q = 0
    assert -3.2 < lowest <= -3.0  # the grid starts just below -3 ...
    assert float(q.scale) > 1.3 * float(p.scale)  # ... instead of at the data minimum
    x = rng.normal(0, 3, (2, 3, 8, 8)).astype(np.float32)
    ref = qm.run({"x": x}, fake_quant=False)["y"].numpy()
    err_flat = np.abs(qm.run({"x": x})["y"].numpy() - ref).mean()
    err_plain = np.abs(plain.run({"x": x})["y"].numpy() - ref).mean()
    assert err_flat < err_plain
