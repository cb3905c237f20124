"""Small models for the cases of issue 19's "the rest found" (tests/*/test_*_found.py)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto as TP
from onnx import helper as oh
from onnx import numpy_helper as nh

from tests.helpers.ir import make_model


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           inits: list[onnx.TensorProto], name: str, opset: int = 13) -> onnx.ModelProto:
    model = make_model(oh.make_graph(nodes, name, inputs, outputs, inits),
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


def initializer_inputs_model(seed: int = 0) -> onnx.ModelProto:
    """x[1,3,8,8] -> Conv(w, b) -> Relu -> GlobalAveragePool -> Flatten -> Gemm(wg, bg) -> y[1,5], IR 8, with every
    weight also listed among the graph inputs (as torch.onnx.export(..., keep_initializers_as_inputs=True) does)."""
    rng = np.random.default_rng(seed)
    arrays = {"w": 0.3 * rng.standard_normal((6, 3, 3, 3)), "b": 0.1 * rng.standard_normal(6),
              "wg": 0.3 * rng.standard_normal((5, 6)), "bg": 0.1 * rng.standard_normal(5)}
    inits = [nh.from_array(a.astype(np.float32), k) for k, a in arrays.items()]
    nodes = [oh.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             oh.make_node("Relu", ["c"], ["r"], name="relu"),
             oh.make_node("GlobalAveragePool", ["r"], ["g"], name="gap"),
             oh.make_node("Flatten", ["g"], ["f"], name="flatten"),
             oh.make_node("Gemm", ["f", "wg", "bg"], ["y"], name="fc", transB=1)]
    inputs = [oh.make_tensor_value_info("x", TP.FLOAT, [1, 3, 8, 8])]
    inputs += [oh.make_tensor_value_info(k, TP.FLOAT, list(a.shape)) for k, a in arrays.items()]
    return _model(nodes, inputs, [oh.make_tensor_value_info("y", TP.FLOAT, [1, 5])], inits, "initializer_inputs")


def untyped_io(case: str, seed: int = 0) -> onnx.ModelProto:
    """x[1,3,8,8] -> Conv 3x3 (3->4) -> Relu -> y[1,4,8,8], with one declared type left incomplete (onnxruntime runs
    each): 'output_no_type' (y has no type at all), 'output_no_elem' (a tensor type without element type or shape),
    'output_no_shape', 'input_no_shape' (x and y: element type only)."""
    rng = np.random.default_rng(seed)
    w = nh.from_array((0.3 * rng.standard_normal((4, 3, 3, 3))).astype(np.float32), "w")
    x = oh.make_tensor_value_info("x", TP.FLOAT, [1, 3, 8, 8])
    y = oh.make_tensor_value_info("y", TP.FLOAT, [1, 4, 8, 8])
    if case == "output_no_type":
        y = onnx.ValueInfoProto(name="y")
    elif case == "output_no_elem":
        y = onnx.ValueInfoProto(name="y")
        y.type.tensor_type.SetInParent()
    elif case == "output_no_shape":
        y = oh.make_tensor_value_info("y", TP.FLOAT, None)
    elif case == "input_no_shape":
        x, y = oh.make_tensor_value_info("x", TP.FLOAT, None), oh.make_tensor_value_info("y", TP.FLOAT, None)
    nodes = [oh.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             oh.make_node("Relu", ["c"], ["y"], name="relu")]
    return _model(nodes, [x], [y], [w], "untyped_io")


def bad_constant_reshape() -> onnx.ModelProto:
    """y = x[4,2] + Reshape(arange(6), [4, 2]): a constant Reshape of 6 values to 8 (invalid whatever the input)."""
    c = nh.from_array(np.arange(6, dtype=np.float32), "c")
    shape = nh.from_array(np.array([4, 2], np.int64), "shp")
    nodes = [oh.make_node("Reshape", ["c", "shp"], ["cr"], name="bad_reshape"),
             oh.make_node("Add", ["x", "cr"], ["y"], name="add")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [4, 2])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, [4, 2])], [c, shape], "bad_reshape")


def wide_conv(seed: int = 0) -> onnx.ModelProto:
    """x[1,32,8,8] -> Conv 3x3 (32->64) -> Relu -> y[1,64,8,8]: 18k int8 weights, more than a 12 kB disk holds."""
    rng = np.random.default_rng(seed)
    w = nh.from_array((rng.standard_normal((64, 32, 3, 3)) / 10).astype(np.float32), "w")
    nodes = [oh.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
             oh.make_node("Relu", ["c"], ["y"], name="relu")]
    return _model(nodes, [oh.make_tensor_value_info("x", TP.FLOAT, [1, 32, 8, 8])],
                  [oh.make_tensor_value_info("y", TP.FLOAT, [1, 64, 8, 8])], [w], "wide_conv")
