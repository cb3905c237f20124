"""Small models for the output-safety and model-compatibility tests (onnx.helper, no torch export)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.ir import make_model


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           inits: list[onnx.TensorProto] = (), opset: int = 13, ir: int = 8,
           extra_opsets: tuple[tuple[str, int], ...] = ()) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(inits))
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in extra_opsets]
    model = make_model(graph, opset_imports=opsets)
    model.ir_version = ir
    return model


def conv_relu(batch: int | str = 1, *, output_shape: bool = True, seed: int = 0) -> onnx.ModelProto:
    """x[batch,3,8,8] -> Conv -> Relu -> Conv: int8 Conv kernels that agree with netquant on any x86 CPU."""
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal(4) * 0.1).astype(np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((4, 4, 3, 3)) * 0.3).astype(np.float32), "w2")]
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["y"], name="conv2", pads=[1, 1, 1, 1])]
    out = helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4, 8, 8] if output_shape else None)
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 8, 8])], [out], inits)


def conv_gemm(weight_scale: float = 1.0, seed: int = 0) -> onnx.ModelProto:
    """x[1,8,16,16] -> Conv(16) -> Relu -> Conv(16) -> Relu -> GlobalAveragePool -> Flatten -> Gemm(10), no biases:
    y is proportional to x and to every weight (all weights x weight_scale), and every op is int8 in
    onnxruntime_int8."""
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.3 * weight_scale).astype(np.float32)

    inits = [numpy_helper.from_array(w(16, 8, 3, 3), "w1"), numpy_helper.from_array(w(16, 16, 3, 3), "w2"),
             numpy_helper.from_array(w(10, 16), "w3")]
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], name="conv2", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
             helper.make_node("GlobalAveragePool", ["r2"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flat"),
             helper.make_node("Gemm", ["f", "w3"], ["y"], name="fc", transB=1)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 16, 16])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 10])], inits)


def ir3_opset7() -> onnx.ModelProto:
    """conv_relu as an IR-3 / opset-7 model: every initializer is listed among the graph inputs too."""
    model = conv_relu()
    model.opset_import[0].version = 7
    model.ir_version = 3
    for t in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    onnx.checker.check_model(model)
    return model


def fp16_matmul() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.random.default_rng(0).random((4, 4)).astype(np.float16), "w")
    return _model([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 4])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 4])], [w])


def custom_domain(domain: str) -> onnx.ModelProto:
    """conv_relu followed by a node of a custom domain ('custom_op', op type 'Twice')."""
    model = conv_relu()
    model.graph.node[-1].output[0] = "c2"
    model.graph.node.append(helper.make_node("Twice", ["c2"], ["y"], name="custom_op", domain=domain))
    model.opset_import.append(helper.make_opsetid(domain, 1))
    return model


def token_embedding(vocab: int = 100) -> onnx.ModelProto:
    """ids[N,6] int64 -> Gather from a [vocab, 8] table -> Relu."""
    table = numpy_helper.from_array(np.random.default_rng(0).standard_normal((vocab, 8)).astype(np.float32), "emb")
    return _model([helper.make_node("Gather", ["emb", "ids"], ["e"], name="embed"),
                   helper.make_node("Relu", ["e"], ["y"], name="relu")],
                  [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N", 6])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6, 8])], [table])


def dynamic_relu() -> onnx.ModelProto:
    """x[N,C] -> Relu: fully dynamic, nothing to quantize."""
    return _model([helper.make_node("Relu", ["x"], ["y"], name="relu")],
                  [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "C"])],
                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "C"])])


def no_inputs() -> onnx.ModelProto:
    const = helper.make_node("Constant", [], ["y"], name="const",
                             value=numpy_helper.from_array(np.ones(3, np.float32)))
    return _model([const], [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])])


def images(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, 8, 8)).astype(np.float32)


def ort_run(path_or_model: object, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    import onnxruntime as ort

    src = path_or_model.SerializeToString() if isinstance(path_or_model, onnx.ModelProto) else str(path_or_model)
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"]).run(None, feeds)


def quantize_cli(*args: object) -> object:
    """`netquant quantize ARGS --allow-float` in-process (the tiny models here keep ops onnxruntime runs faster in
    float; the tests using it are about files, not placement)."""
    from click.testing import CliRunner

    from netquant.cli.main import cli

    return CliRunner().invoke(cli, ["quantize", *map(str, args), "--allow-float"], catch_exceptions=False)
