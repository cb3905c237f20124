"""Small ONNX models (built with onnx.helper) for the quantizer, platform and API tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.ir import make_model

RNG_SEED = 1234
IR_VERSION = 8  # loadable by every onnxruntime we support


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(arr.astype(np.float32) if arr.dtype.kind == "f" else arr, name)


def _const_node(name: str, arr: np.ndarray) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], name=f"const_{name}",
                            value=numpy_helper.from_array(arr.astype(np.float32), f"{name}_value"))


def conv_relu_gemm(weights_as_constants: bool = False, opset: int = 13) -> onnx.ModelProto:
    """x[N,3,8,8] -> Conv(16) -> Relu -> MaxPool(2) -> Reshape[N,256] -> Gemm(transB=1, 5) -> y."""
    rng = np.random.default_rng(RNG_SEED)
    w = rng.normal(0, 0.3, (16, 3, 3, 3))
    b = rng.normal(0, 0.1, (16,))
    w2 = rng.normal(0, 0.1, (5, 256))
    b2 = rng.normal(0, 0.1, (5,))
    shape = np.array([0, -1], dtype=np.int64)
    nodes = [
        helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Reshape", ["p", "shape"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "W2", "B2"], ["y"], name="fc", transB=1),
    ]
    inits = [numpy_helper.from_array(shape, "shape")]
    if weights_as_constants:
        nodes = [_const_node("W", w), _const_node("B", b), _const_node("W2", w2), _const_node("B2", b2), *nodes]
    else:
        inits += [_init("W", w), _init("B", b), _init("W2", w2), _init("B2", b2)]
    graph = helper.make_graph(nodes, "conv_relu_gemm",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def residual_concat(opset: int = 13) -> onnx.ModelProto:
    """x -> conv1 -> a; conv2(a) -> b; Add(a, b) -> s; Sigmoid(s) -> g; Concat(a, g) -> cat; conv3(cat) -> y."""
    rng = np.random.default_rng(RNG_SEED + 1)
    inits = [_init("W1", rng.normal(0, 0.3, (16, 3, 3, 3))), _init("B1", rng.normal(0, 0.1, (16,))),
             _init("W2", rng.normal(0, 0.1, (16, 16, 3, 3))), _init("B2", rng.normal(0, 0.1, (16,))),
             _init("W3", rng.normal(0, 0.2, (16, 32, 1, 1))), _init("B3", rng.normal(0, 0.1, (16,)))]
    nodes = [
        helper.make_node("Conv", ["x", "W1", "B1"], ["a"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["a", "W2", "B2"], ["b"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["a", "b"], ["s"], name="add"),
        helper.make_node("Sigmoid", ["s"], ["g"], name="sigmoid"),
        helper.make_node("Concat", ["a", "g"], ["cat"], name="concat", axis=1),
        helper.make_node("Conv", ["cat", "W3", "B3"], ["y"], name="conv3"),
    ]
    graph = helper.make_graph(nodes, "residual_concat",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, 8, 8])], inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def matmul_model(opset: int = 13) -> onnx.ModelProto:
    """x[N,6,8] -> MatMul(W[8,12]) -> h; MatMul(h, h^T) (activation x activation) -> y."""
    rng = np.random.default_rng(RNG_SEED + 2)
    inits = [_init("Wm", rng.normal(0, 0.3, (8, 12)))]
    nodes = [
        helper.make_node("MatMul", ["x", "Wm"], ["h"], name="proj"),
        helper.make_node("Transpose", ["h"], ["ht"], name="tr", perm=[0, 2, 1]),
        helper.make_node("MatMul", ["h", "ht"], ["y"], name="attn"),
    ]
    graph = helper.make_graph(nodes, "matmul_model",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6, 6])], inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def dynamic_weight_conv(opset: int = 13) -> onnx.ModelProto:
    """Conv whose weight is a graph input (not a constant): cannot be quantized."""
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], name="dynconv")]
    graph = helper.make_graph(nodes, "dynamic_weight_conv",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 5, 5]),
                               helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 2, 3, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 3, 3])])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=IR_VERSION)
    onnx.checker.check_model(model)
    return model


def calib_batches(shape: tuple[int, ...], n: int = 4, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(0, 1, shape).astype(np.float32) for _ in range(n)]
