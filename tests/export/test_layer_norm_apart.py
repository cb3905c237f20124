"""export.layer_norm_apart: residual sums kept apart from LayerNormalization, checked in onnxruntime."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.export.layer_norm_apart import keep_layer_norms_apart
from tests.helpers.ir import make_model
from tests.helpers.ort_sessions import one_thread_session as _session

SHAPE = [1, 8, 16]


def _add_layer_norm(readers: int = 1, output: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(16)).astype(np.float32), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(16)).astype(np.float32), "beta")]
    nodes = [helper.make_node("Add", ["x", "y"], ["s"], name="residual"),
             helper.make_node("LayerNormalization", ["s", "gamma", "beta"], ["z"], axis=-1, epsilon=1e-5)]
    outs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, SHAPE)]
    if readers > 1:
        nodes.append(helper.make_node("Relu", ["s"], ["r"]))
        outs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, SHAPE))
    if output:
        outs.append(helper.make_tensor_value_info("s", TensorProto.FLOAT, SHAPE))
    graph = helper.make_graph(nodes, "add_ln", [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE)
                                                for n in ("x", "y")], outs, inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _skip_layer_norm(extra_output: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((1 + 0.1 * rng.standard_normal(16)).astype(np.float32), "gamma"),
             numpy_helper.from_array((0.1 * rng.standard_normal(16)).astype(np.float32), "beta"),
             numpy_helper.from_array((0.1 * rng.standard_normal(16)).astype(np.float32), "bias")]
    outputs = ["z", "", "", "sum"] if extra_output else ["z"]
    nodes = [helper.make_node("SkipLayerNormalization", ["x", "y", "gamma", "beta", "bias"], outputs, name="sln",
                              domain="com.microsoft", epsilon=1e-5)]
    outs = [helper.make_tensor_value_info("z", TensorProto.FLOAT, SHAPE)]
    if extra_output:
        outs.append(helper.make_tensor_value_info("sum", TensorProto.FLOAT, SHAPE))
    graph = helper.make_graph(nodes, "sln", [helper.make_tensor_value_info(n, TensorProto.FLOAT, SHAPE)
                                             for n in ("x", "y")], outs, inits)
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 8
    return model


def _feeds() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(2)
    return {n: rng.standard_normal(SHAPE).astype(np.float32) for n in ("x", "y")}


def _optimized_ops(model: onnx.ModelProto, tmp_path: Path) -> Counter[str]:
    saved = tmp_path / "optimized.onnx"
    _session(model, saved=saved)
    return Counter(n.op_type for n in onnx.load(str(saved)).graph.node)


def test_a_residual_add_becomes_a_sum_onnxruntime_does_not_fuse(tmp_path: Path) -> None:
    source = _add_layer_norm()
    assert _optimized_ops(source, tmp_path)["SkipLayerNormalization"] == 1  # what onnxruntime does to the Add
    model = _add_layer_norm()
    assert keep_layer_norms_apart(model, lambda hidden: hidden == 16) == 1
    assert [n.op_type for n in model.graph.node] == ["Sum", "LayerNormalization"]
    assert _optimized_ops(model, tmp_path)["SkipLayerNormalization"] == 0
    feeds = _feeds()
    apart = _session(source, optimized=False).run(None, feeds)[0]  # Add -> LayerNormalization, unfused
    assert np.array_equal(_session(model, optimized=False).run(None, feeds)[0], apart)  # the same sum, bit for bit
    assert np.array_equal(_session(model).run(None, feeds)[0], apart)
    fused = _session(source).run(None, feeds)[0]
    assert np.abs(fused - apart).max() < 1e-5  # SkipLayerNormalization rounds its own way


def test_adds_with_other_readers_or_graph_outputs_or_a_fast_fused_kernel_stay() -> None:
    for model in (_add_layer_norm(readers=2), _add_layer_norm(output=True)):
        assert keep_layer_norms_apart(model, lambda hidden: True) == 0
    model = _add_layer_norm()
    assert keep_layer_norms_apart(model, lambda hidden: False) == 0
    assert model.graph.node[0].op_type == "Add"


def test_a_skip_layer_norm_is_unfused_to_its_formula() -> None:
    source = _skip_layer_norm()
    model = _skip_layer_norm()
    assert keep_layer_norms_apart(model, lambda hidden: True) == 1
    assert [n.op_type for n in model.graph.node] == ["Sum", "LayerNormalization"]
    assert list(model.graph.node[0].input) == ["x", "y", "bias"]
    feeds = _feeds()
    expected = _session(source).run(None, feeds)[0]
    got = _session(model).run(None, feeds)[0]
    s = feeds["x"] + feeds["y"] + numpy_helper.to_array(source.graph.initializer[2])
    mean, var = s.mean(-1, keepdims=True), s.var(-1, keepdims=True)
    by_hand = (s - mean) / np.sqrt(var + 1e-5) * numpy_helper.to_array(source.graph.initializer[0]) + \
        numpy_helper.to_array(source.graph.initializer[1])
    assert np.abs(got - by_hand).max() < 1e-5 and np.abs(expected - by_hand).max() < 1e-5
    kept = _skip_layer_norm(extra_output=True)  # its input_skip_bias_sum is read: left alone
    assert keep_layer_norms_apart(kept, lambda hidden: True) == 0
    old = _skip_layer_norm()
    old.opset_import[0].version = 14  # no ai.onnx LayerNormalization
    assert keep_layer_norms_apart(old, lambda hidden: True) == 0


@pytest.mark.parametrize("slower", [True, False])
def test_exported_static_bert_follows_the_probe(tmp_path: Path, monkeypatch, slower: bool) -> None:
    """A static-shape BERT (what dynamo exports): its residual Adds become Sums where the probe finds onnxruntime's
    SkipLayerNormalization slower, and the file validates in onnxruntime either way."""
    import netquant.export.onnx_qdq as onnx_qdq
    from tests.helpers.transformer_models import small_bert, small_bert_batches

    monkeypatch.setattr(onnx_qdq, "_fused_skip_layer_norm_slower", lambda hidden: slower)
    source = small_bert(tmp_path / "bert.onnx", seq=32)
    qm = netquant.quantize_onnx(str(source), small_bert_batches(4), objective=None, quiet=True)
    report = qm.export(tmp_path / "int8.onnx")
    ops = Counter(n.op_type for n in onnx.load(str(tmp_path / "int8.onnx")).graph.node)
    graph = onnx.load(str(source)).graph
    producer = {o: n.op_type for n in graph.node for o in n.output}
    after_add = sum(n.op_type == "LayerNormalization" and producer.get(n.input[0]) == "Add" for n in graph.node)
    assert after_add == 5 and ops["Sum"] == (after_add if slower else 0)  # embeddings' and each layer's two
    assert report.validated and report.vs_fp32 is not None and report.vs_fp32.outputs[0].cosine > 0.99
