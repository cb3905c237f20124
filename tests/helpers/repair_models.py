"""Random FP32 models for the repair passes' exactness tests (passes.smoothquant, passes.equalization,
passes.adaround): weights random, but channel ranges deliberately uneven (outlier channels, per-channel weight
scales spanning orders of magnitude) so the passes have something to change."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.ir import make_model


def _init(name: str, value: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(value.astype(np.float32), name)


def transformer_model(k: int = 32, h: int = 64, seed: int = 0) -> onnx.ModelProto:
    """x[N, T, k] -> LayerNorm (gamma with 3 outlier channels) -> {MatMul q, MatMul v} (LN output read by both);
    q -> Add bias -> Relu -> MatMul -> Add(residual x) -> LayerNorm -> Gemm-like MatMul + Add -> y;
    v -> y2 (a second output)."""
    rng = np.random.default_rng(seed)
    gamma = rng.uniform(0.5, 1.5, k)
    gamma[[1, 7, 20]] *= 40.0  # outlier channels of the normalized activations
    beta = rng.normal(0, 0.2, k)
    gamma2 = rng.uniform(0.5, 1.5, k)
    gamma2[[3, 11]] *= 30.0
    inits = [
        _init("g1", gamma), _init("b1", beta),
        _init("wq", rng.normal(0, 1 / np.sqrt(k), (k, h))), _init("bq", rng.normal(0, 0.1, h)),
        _init("wv", rng.normal(0, 1 / np.sqrt(k), (k, k))),
        _init("wo", rng.normal(0, 1 / np.sqrt(h), (h, k))),
        _init("g2", gamma2), _init("b2", rng.normal(0, 0.2, k)),
        _init("wf", rng.normal(0, 1 / np.sqrt(k), (k, k))), _init("bf", rng.normal(0, 0.1, k)),
    ]
    nodes = [
        helper.make_node("LayerNormalization", ["x", "g1", "b1"], ["ln1"], name="ln1", axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["ln1", "wq"], ["q0"], name="mm_q"),
        helper.make_node("MatMul", ["ln1", "wv"], ["y2"], name="mm_v"),
        helper.make_node("Add", ["q0", "bq"], ["q1"], name="add_q"),
        helper.make_node("Relu", ["q1"], ["q2"], name="relu_q"),
        helper.make_node("MatMul", ["q2", "wo"], ["o"], name="mm_o"),
        helper.make_node("Add", ["o", "x"], ["r"], name="residual"),
        helper.make_node("LayerNormalization", ["r", "g2", "b2"], ["ln2"], name="ln2", axis=-1, epsilon=1e-5),
        helper.make_node("MatMul", ["ln2", "wf"], ["f0"], name="mm_f"),
        helper.make_node("Add", ["f0", "bf"], ["y"], name="add_f"),
    ]
    graph = helper.make_graph(
        nodes, "transformer", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6, k]),
         helper.make_tensor_value_info("y2", TensorProto.FLOAT, ["N", 6, k])], inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def transformer_inputs(n: int, seed: int, k: int = 32) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, (n, 6, k)).astype(np.float32)


def _conv(name: str, x: str, w: str, b: str, y: str, k: int, group: int = 1) -> onnx.NodeProto:
    return helper.make_node("Conv", [x, w, b], [y], name=name, kernel_shape=[k, k], pads=[k // 2] * 4, group=group)


def cnn_model(c: int = 8, seed: int = 0, relu6: bool = False) -> onnx.ModelProto:
    """x[N, 3, 12, 12] -> Conv3x3 -> Relu -> depthwise Conv3x3 -> Relu -> Conv1x1 -> (+ Conv1x1 of x: a
    residual join) -> PRelu -> Conv1x1 -> Flatten -> Gemm(transB) -> Relu -> Gemm -> y. Output channels of each
    conv get per-channel weight scales spanning ~3 orders of magnitude (what BatchNorm folding leaves)."""
    rng = np.random.default_rng(seed)

    def w(shape: tuple[int, ...]) -> np.ndarray:
        spread = np.exp(rng.uniform(-3.5, 3.5, (shape[0],) + (1,) * (len(shape) - 1)))
        return rng.normal(0, 1 / np.sqrt(np.prod(shape[1:])), shape) * spread

    act = "Clip" if relu6 else "Relu"

    def relu(x: str, y: str, name: str) -> onnx.NodeProto:
        if relu6:
            return helper.make_node("Clip", [x, "zero", "six"], [y], name=name)
        return helper.make_node("Relu", [x], [y], name=name)

    inits = [
        _init("w1", w((c, 3, 3, 3))), _init("c1", rng.normal(0, 0.5, c)),
        _init("w2", w((c, 1, 3, 3))), _init("c2", rng.normal(0.5, 0.5, c)),
        _init("w3", w((c, c, 1, 1))), _init("c3", rng.normal(0, 0.5, c)),
        _init("ws", w((c, 3, 1, 1))), _init("cs", rng.normal(0, 0.5, c)),
        _init("slope", rng.uniform(0.05, 0.3, (c, 1, 1))),
        _init("w4", w((c, c, 1, 1))), _init("c4", rng.normal(0, 0.5, c)),
        _init("g1", w((16, c * 4))), _init("d1", rng.normal(0, 0.5, 16)),
        _init("g2", rng.normal(0, 0.3, (16, 5))), _init("d2", rng.normal(0, 0.5, 5)),
        _init("zero", np.array(0.0)), _init("six", np.array(6.0)),
    ]
    nodes = [
        _conv("conv1", "x", "w1", "c1", "a1", 3),
        relu("a1", "r1", f"{act.lower()}1"),
        _conv("dw", "r1", "w2", "c2", "a2", 3, group=c),
        relu("a2", "r2", f"{act.lower()}2"),
        _conv("pw", "r2", "w3", "c3", "a3", 1),
        _conv("skip", "x", "ws", "cs", "sk", 1),
        helper.make_node("Add", ["a3", "sk"], ["s"], name="join"),
        helper.make_node("PRelu", ["s", "slope"], ["p"], name="prelu"),
        _conv("pw2", "p", "w4", "c4", "a4", 1),
        helper.make_node("MaxPool", ["a4"], ["m"], name="pool", kernel_shape=[6, 6], strides=[6, 6]),
        helper.make_node("Flatten", ["m"], ["f"], name="flat"),
        helper.make_node("Gemm", ["f", "g1", "d1"], ["h"], name="fc1", transB=1),
        helper.make_node("Relu", ["h"], ["hr"], name="relu_fc"),
        helper.make_node("Gemm", ["hr", "g2", "d2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes, "cnn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    return model


def cnn_inputs(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, (n, 3, 12, 12)).astype(np.float32)


def run_passes_alone(model, calib, repair):
    """The FP32 graph after the data check and `repair` alone, and the run context."""
    from netquant.graph.load import load_onnx
    from netquant.passes.base import PassContext
    from netquant.passes.check_data import CheckDataPass
    from netquant.passes.manager import PassManager
    from netquant.passes.settings import QuantSettings

    graph = load_onnx(model)
    ctx = PassContext(settings=QuantSettings.from_kwargs("onnxruntime_int8", {"quiet": True}), graph=graph)
    PassManager([CheckDataPass(calib), repair]).run(ctx)
    return graph, ctx


def ort_run(model, x):
    """The model's outputs in onnxruntime for input x."""
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})


def rel(a, b) -> float:
    """max |a - b| / max |b|."""
    return float(abs(a - b).max() / abs(b).max())



def mobilenet_v2_model(c: int = 8, expand: int = 4, blocks: int = 2, seed: int = 0) -> onnx.ModelProto:
    """x[N, 3, 12, 12] -> stem Conv3x3 -> ReLU6 -> `blocks` inverted residual blocks (Conv1x1 expand -> ReLU6 ->
    depthwise Conv3x3 -> ReLU6 -> Conv1x1 project, + the block input: a residual join) -> GlobalAveragePool ->
    Flatten -> Gemm -> y[N, 5]: MobileNetV2's layout with BatchNorm folded. Channel scales span ~3 orders of
    magnitude and biases sit high, so every ReLU6 clips some channels (what equalization must keep exact)."""
    rng = np.random.default_rng(seed)

    def w(shape: tuple[int, ...]) -> np.ndarray:
        spread = np.exp(rng.uniform(-3.5, 3.5, (shape[0],) + (1,) * (len(shape) - 1)))
        return rng.normal(0, 1.5 / np.sqrt(np.prod(shape[1:])), shape) * spread

    inits = [_init("zero", np.array(0.0)), _init("six", np.array(6.0)), _init("stem_w", w((c, 3, 3, 3))),
             _init("stem_b", rng.normal(1.0, 1.0, c))]
    nodes = [_conv("stem", "x", "stem_w", "stem_b", "stem_a", 3),
             helper.make_node("Clip", ["stem_a", "zero", "six"], ["h0"], name="stem_relu6")]
    h = c * expand
    for i in range(blocks):
        x, p = f"h{i}", f"b{i}_"
        inits += [_init(p + "ew", w((h, c, 1, 1))), _init(p + "eb", rng.normal(1.0, 1.0, h)),
                  _init(p + "dw", w((h, 1, 3, 3))), _init(p + "db", rng.normal(1.0, 1.0, h)),
                  _init(p + "pw", w((c, h, 1, 1))), _init(p + "pb", rng.normal(0, 0.5, c))]
        nodes += [_conv(p + "expand", x, p + "ew", p + "eb", p + "ea", 1),
                  helper.make_node("Clip", [p + "ea", "zero", "six"], [p + "er"], name=p + "expand_relu6"),
                  _conv(p + "depthwise", p + "er", p + "dw", p + "db", p + "da", 3, group=h),
                  helper.make_node("Clip", [p + "da", "zero", "six"], [p + "dr"], name=p + "depthwise_relu6"),
                  _conv(p + "project", p + "dr", p + "pw", p + "pb", p + "pa", 1),
                  helper.make_node("Add", [x, p + "pa"], [f"h{i + 1}"], name=p + "join")]
    inits += [_init("fc_w", rng.normal(0, 0.3, (5, c))), _init("fc_b", rng.normal(0, 0.5, 5))]
    nodes += [helper.make_node("GlobalAveragePool", [f"h{blocks}"], ["gap"], name="gap"),
              helper.make_node("Flatten", ["gap"], ["flat"], name="flat"),
              helper.make_node("Gemm", ["flat", "fc_w", "fc_b"], ["y"], name="fc", transB=1)]
    graph = helper.make_graph(
        nodes, "mobilenet_v2", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 12, 12])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 5])], inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    onnx.checker.check_model(model)
    return model
