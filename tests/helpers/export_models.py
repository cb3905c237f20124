"""Small ONNX models built with onnx.helper for the export / CLI tests (no torch export, fast)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.ir import make_model


def _init(name: str, array: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(array.astype(np.float32), name)


def conv_net(opset: int = 13, batch: int | str = "N", channels: int = 8, gemm_out: int = 10,
             seed: int = 0, weights_as_constants: bool = False) -> onnx.ModelProto:
    """x[N,3,16,16] -> Conv(+bias) -> BN -> Relu -> Conv -> Add(residual) -> MaxPool -> GAP -> Flatten -> Gemm."""
    rng = np.random.default_rng(seed)
    c = channels
    weights = {
        "w1": rng.standard_normal((c, 3, 3, 3)) * 0.3, "b1": rng.standard_normal(c) * 0.1,
        "bn_scale": 1 + 0.1 * rng.standard_normal(c), "bn_bias": 0.1 * rng.standard_normal(c),
        "bn_mean": 0.1 * rng.standard_normal(c), "bn_var": 1 + 0.1 * rng.random(c),
        "w2": rng.standard_normal((c, c, 3, 3)) * 0.2, "b2": rng.standard_normal(c) * 0.1,
        "wg": rng.standard_normal((gemm_out, c)) * 0.3, "bg": rng.standard_normal(gemm_out) * 0.1,
    }
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
        helper.make_node("BatchNormalization", ["c1", "bn_scale", "bn_bias", "bn_mean", "bn_var"], ["bn1"],
                         name="bn1"),
        helper.make_node("Relu", ["bn1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Add", ["r1", "r2"], ["s"], name="add"),
        helper.make_node("MaxPool", ["s"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["p"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "wg", "bg"], ["y"], name="fc", transB=1),
    ]
    inits = [_init(k, v) for k, v in weights.items()]
    if weights_as_constants:  # PaddleOCR style: weights in Constant nodes
        consts = [helper.make_node("Constant", [], [t.name], name=f"const_{t.name}", value=t) for t in inits]
        nodes, inits = consts + nodes, []
    graph = helper.make_graph(
        nodes, "conv_net",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 16, 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, gemm_out])], inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7 if opset <= 12 else 8
    onnx.checker.check_model(model)
    return model


def mlp(features: int = 256, hidden: int = 512, out: int = 16, seed: int = 0) -> onnx.ModelProto:
    """x[N,features] -> MatMul -> Add -> Relu -> Gemm: big weights, for the file-size check."""
    rng = np.random.default_rng(seed)
    inits = [_init("w1", rng.standard_normal((features, hidden)) * 0.05), _init("b1", rng.standard_normal(hidden) * 0.1),
             _init("w2", rng.standard_normal((hidden, out)) * 0.05), _init("b2", rng.standard_normal(out) * 0.1)]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["m"], name="mm1"),
             helper.make_node("Add", ["m", "b1"], ["a"], name="add1"),
             helper.make_node("Relu", ["a"], ["r"], name="relu"),
             helper.make_node("Gemm", ["r", "w2", "b2"], ["y"], name="fc2")]
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", out])], inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def gemm_softmax(opset: int = 11, features: int = 16, classes: int = 4, seed: int = 0) -> onnx.ModelProto:
    """x[N,features] -> Gemm -> Softmax = y: the last op's output is the graph output (PP-OCR cls's tail)."""
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["logits"], name="fc", transB=1),
             helper.make_node("Softmax", ["logits"], ["y"], name="softmax", axis=1)]
    graph = helper.make_graph(nodes, "gemm_softmax",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", features])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", classes])],
                              [_init("w", rng.standard_normal((classes, features)) * 0.5),
                               _init("b", rng.standard_normal(classes) * 0.1)])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 7 if opset <= 12 else 8
    onnx.checker.check_model(model)
    return model


def conv_with_runtime_weight() -> onnx.ModelProto:
    """A Conv whose weight is computed from a graph input (not a constant): platforms cannot quantize it."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Conv", ["x", "w0"], ["c0"], name="conv_const", pads=[1, 1, 1, 1]),
             helper.make_node("Reshape", ["w_flat", "w_shape"], ["w_in"], name="weight_reshape"),
             helper.make_node("Conv", ["c0", "w_in"], ["y"], name="conv_dynamic_weight", pads=[1, 1, 1, 1])]
    graph = helper.make_graph(
        nodes, "runtime_weight",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8]),
         helper.make_tensor_value_info("w_flat", TensorProto.FLOAT, [1, 144])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [_init("w0", rng.standard_normal((4, 3, 3, 3)) * 0.3),
         numpy_helper.from_array(np.array([4, 4, 3, 3], dtype=np.int64), "w_shape")])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def images(n: int = 16, seed: int = 0) -> np.ndarray:
    """Calibration batch for conv_net: smooth-ish random images (N, 3, 16, 16)."""
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, 3, 16, 16)).astype(np.float32)
