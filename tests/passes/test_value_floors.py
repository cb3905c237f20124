"""Value floors (passes.value_floors): hard-swish's minimum as both engines compute it, and floors carried through
affine ops with constant operands, checked against the engines' own values."""

from __future__ import annotations

import math

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

from netquant.graph import Executor, load_onnx
from netquant.passes.value_floors import stationary_floor, value_floors
from tests.helpers.ir import make_model


def test_hard_swish_floor_is_its_minimum_in_both_engines() -> None:
    assert stationary_floor(1 / 6, 0.5) == -0.375  # x * HardSigmoid(x): -beta^2 / (4 alpha) at x = -1.5
    assert stationary_floor(None) == -0.375  # the HardSwish op
    assert stationary_floor(0.2, 0.5) == float(np.float32(-0.3125))  # -0.25 / 0.8
    assert stationary_floor(-0.2, 0.5) is None and stationary_floor(0.2, 1.5) is None
    # the engines on a dense grid through the vertex never go below it
    xs = np.linspace(-3.5, 1.0, 200_001, dtype=np.float32)
    nodes = [helper.make_node("HardSwish", ["x"], ["y"])]
    model = make_model(helper.make_graph(nodes, "hs", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                             [None])],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None])]),
                              opset_imports=[helper.make_opsetid("", 14)])
    by_ort = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": xs})[0]
    by_ex = Executor(load_onnx(model)).run({"x": torch.from_numpy(xs)})["y"]
    assert float(by_ort.min()) >= -0.375 and float(by_ex.min()) >= -0.375


def _affine_graph(k: float, b: float) -> object:
    nodes = [helper.make_node("HardSwish", ["x"], ["a"]), helper.make_node("Mul", ["a", "k"], ["ka"]),
             helper.make_node("Sub", ["ka", "b"], ["z"]), helper.make_node("Div", ["z", "k"], ["d"]),
             helper.make_node("Sub", ["b", "ka"], ["neg"])]
    inits = [numpy_helper.from_array(np.array([k], np.float32), "k"),
             numpy_helper.from_array(np.array([b, 2 * b], np.float32), "b")]
    graph = helper.make_graph(nodes, "affine", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in ("d", "neg")], inits)
    return load_onnx(make_model(graph, opset_imports=[helper.make_opsetid("", 14)]))


def test_floors_follow_affine_ops_with_constants() -> None:
    f32 = np.float32
    floors = value_floors(_affine_graph(0.7, 0.1), lambda n: -math.inf)
    ka = float(f32(f32(-0.375) * f32(0.7)))
    assert floors["a"] == -0.375 and floors["ka"] == ka
    assert floors["z"] == float(min(f32(ka) - f32(0.1), f32(ka) - f32(0.2)))  # the smallest over the constant's values
    assert floors["d"] == float(f32(floors["z"]) / f32(0.7))
    assert "neg" not in floors  # b - t decreases with t: no floor
    assert "ka" not in value_floors(_affine_graph(-0.7, 0.1), lambda n: -math.inf)  # a negative factor flips it


def test_probe_model_loads_in_every_supported_onnxruntime() -> None:
    """The probe's model has an IR version onnxruntime 1.20 (the project's floor) loads: onnx 1.23's default (14)
    is refused by onnxruntime before 1.31 ("Unsupported model IR version"), which lost the floor there."""
    import onnx

    from netquant.passes.value_floors import _hard_swish_model

    for alpha in (None, 0.2):
        model = onnx.load_from_string(_hard_swish_model(alpha, 0.5))
        assert model.ir_version == 8
        onnx.checker.check_model(model)
