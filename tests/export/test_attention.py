"""export.attention: transformer ops (Q·Kᵀ, A·V, Softmax, LayerNorm, GELU) rewritten to int8, and per-token dynamic
activations, checked in onnxruntime against the float file and a numpy reference."""

from __future__ import annotations

import copy
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.analysis.attention import calibrated_ranges
from netquant.export.attention import (
    AttnKind,
    AttnMode,
    apply_attention,
    find_attention_ops,
    per_token_dynamic,
    tensors_to_range,
)
from netquant.export.dynamic import make_dynamic
from netquant.export.onnx_qdq import build_qdq_model, fp32_onnx
from tests.helpers.ir import make_model
from tests.helpers.transformer_models import SMALL, cosine, small_bert, small_bert_batches


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[onnx.ModelProto, onnx.ModelProto, dict]:
    """(QDQ export with the platform's rules, its FP32 graph, ranges of every attention tensor)."""
    path = small_bert(tmp_path_factory.mktemp("bert") / "bert.onnx", seq=32)
    q = netquant.quantize_onnx(str(path), small_bert_batches(4), objective=None, quiet=True)
    base, fp32 = build_qdq_model(q.qgraph)[0], fp32_onnx(q.qgraph)
    kinds = find_attention_ops(base)
    return base, fp32, calibrated_ranges(fp32, tensors_to_range(base, kinds), small_bert_batches(4))


def test_every_transformer_op_is_found(bert: tuple[onnx.ModelProto, onnx.ModelProto, dict]) -> None:
    base, _, ranges = bert
    kinds = Counter(find_attention_ops(base).values())
    layers = SMALL["layers"]
    assert kinds == {AttnKind.SCORES: layers, AttnKind.CONTEXT: layers, AttnKind.SOFTMAX: layers,
                     AttnKind.LAYERNORM: 2 * layers + 1, AttnKind.GELU: layers}
    # the additive mask (-10000) is left out of the Softmax input's range: the scores' own scale stays fine
    assert all(-1e4 < lo <= hi < 1e4 for lo, hi in ranges.values())


@pytest.mark.parametrize("mode", [AttnMode.STATIC, AttnMode.DYNAMIC])
def test_attention_matmuls_in_int8_stay_close_to_float(bert: tuple[onnx.ModelProto, onnx.ModelProto, dict],
                                                       mode: AttnMode) -> None:
    base, _, ranges = bert
    kinds = find_attention_ops(base)
    products = {n: mode for n, k in kinds.items() if k in (AttnKind.SCORES, AttnKind.CONTEXT)}
    model = copy.deepcopy(base)
    assert sorted(apply_attention(model, products, ranges)) == sorted(products)
    onnx.checker.check_model(model, full_check=True)
    ops, before = Counter(n.op_type for n in model.graph.node), Counter(n.op_type for n in base.graph.node)
    if mode is AttnMode.STATIC:  # Q -> DQ on both inputs of each product (none shared between them here)
        assert ops["QuantizeLinear"] - before["QuantizeLinear"] == 2 * len(products)
    else:
        assert ops["MatMulInteger"] - before["MatMulInteger"] == len(products)
        assert ops["DynamicQuantizeLinear"] - before["DynamicQuantizeLinear"] == 2 * len(products)
    for feeds in small_bert_batches(3, seed=50):
        assert cosine(_run(base, feeds), _run(model, feeds)) > 0.999


def test_softmax_layernorm_gelu_get_qdq_on_input_and_output(bert: tuple[onnx.ModelProto, onnx.ModelProto, dict]
                                                           ) -> None:
    base, _, ranges = bert
    kinds = find_attention_ops(base)
    for kind in (AttnKind.SOFTMAX, AttnKind.LAYERNORM, AttnKind.GELU):
        model = copy.deepcopy(base)
        chosen = {n: AttnMode.STATIC for n, k in kinds.items() if k is kind}
        assert sorted(apply_attention(model, chosen, ranges)) == sorted(chosen)
        onnx.checker.check_model(model, full_check=True)
        feeds = small_bert_batches(1, seed=60)[0]
        assert cosine(_run(base, feeds), _run(model, feeds)) > 0.99, kind


def _dynamic_linear(w_q: np.ndarray, w_s: np.ndarray) -> onnx.ModelProto:
    """y = x @ W in export.dynamic's form: DynamicQuantizeLinear -> MatMulInteger(int8 W) -> Cast -> Mul(s_x s_w)."""
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"], name="mm/DynamicQuantizeLinear"),
             helper.make_node("MatMulInteger", ["xq", "wq", "xz"], ["acc"], name="mm"),
             helper.make_node("Cast", ["acc"], ["accf"], name="mm/Cast", to=TensorProto.FLOAT),
             helper.make_node("Mul", ["xs", "ws"], ["s"], name="mm/scale"),
             helper.make_node("Mul", ["accf", "s"], ["y"], name="mm/Mul")]
    graph = helper.make_graph(nodes, "dyn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 8])],
                              [numpy_helper.from_array(w_q, "wq"), numpy_helper.from_array(w_s, "ws")])
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_per_token_scales_match_a_numpy_reference() -> None:
    rng = np.random.default_rng(0)
    w_q = rng.integers(-127, 128, (16, 8)).astype(np.int8)
    w_s = (rng.random(8) * 0.01 + 0.001).astype(np.float32)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    x[2] *= 50.0  # one outlier token: per tensor, it sets everyone's scale
    model = _dynamic_linear(w_q, w_s)
    per_tensor = _run(model, {"x": x})
    assert per_token_dynamic(model) == ["mm"]
    onnx.checker.check_model(model, full_check=True)
    got = _run(model, {"x": x})
    s = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
    q = np.round(x / s).astype(np.int32)
    want = (q @ w_q.astype(np.int32)).astype(np.float32) * s * w_s
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    exact = x @ (w_q.astype(np.float32) * w_s)
    small = [0, 1, 3, 4]  # the ordinary tokens: far more accurate with their own scale
    assert np.abs(got - exact)[small].max() < 0.2 * np.abs(per_tensor - exact)[small].max()


def test_per_token_on_a_dynamic_bert_stays_close(tmp_path: Path) -> None:
    path = small_bert(tmp_path / "bert.onnx", seq=32)
    q = netquant.quantize_onnx(str(path), small_bert_batches(4), objective=None, quiet=True)
    model = build_qdq_model(q.qgraph)[0]
    g = q.qgraph.graph
    linears = [n.name for n in g.nodes if n.op_type == "MatMul" and n.inputs[1] in g.initializers]
    make_dynamic(model, linears)
    tokens = copy.deepcopy(model)
    assert len(per_token_dynamic(tokens)) == len(linears)
    onnx.checker.check_model(tokens, full_check=True)
    ref = onnx.load(str(path))
    for feeds in small_bert_batches(2, seed=70):
        assert cosine(_run(ref, feeds), _run(tokens, feeds)) > 0.999
