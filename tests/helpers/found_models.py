"""Small models for the cases of issue 19's "the rest found" (tests/*/test_*_found.py)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           inits: list[onnx.TensorProto], name: str, opset: int = 13) -> onnx.ModelProto:
    model = oh.make_model(oh.make_graph(nodes, name, inputs, outputs, inits),
                          opset_imports=[oh.make_opsetid("", opset)], ir_version=8)
    return model


def gray_conv(seed: int = 0) -> onnx.ModelProto:
    """x[1,1,16,16] (one channel: grayscale images) -> Conv 3x3 (1->4) -> Relu -> y[1,4,16,16]."""
    rng = np.random.default_rng(seed)
    w = nh.from_array((0.5 * rng.standard_normal((4, 1, 3, 3))).astype(np.float32), "w")
    nodes = [oh.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             oh.make_node("Relu", ["c"], ["y"], name="relu")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [1, 1, 16, 16])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, [1, 4, 16, 16])], [w], "gray_conv")


def scalar_gain(seed: int = 0) -> onnx.ModelProto:
    """x[1,8] and a scalar (0-d) gain s: y = (x * s) @ W, W[8,4]."""
    rng = np.random.default_rng(seed)
    w = nh.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w")
    nodes = [oh.make_node("Mul", ["x", "s"], ["t"], name="mul"), oh.make_node("MatMul", ["t", "w"], ["y"], name="mm")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [1, 8]), oh.make_tensor_value_info("s", TP.FLOAT, [])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, [1, 4])], [w], "scalar_gain")


def scalar_gain_reference(x: np.ndarray, s: np.ndarray, seed: int = 0) -> np.ndarray:
    """scalar_gain's output in numpy."""
    w = np.random.default_rng(seed).standard_normal((8, 4)).astype(np.float32)
    return (x * s) @ w
