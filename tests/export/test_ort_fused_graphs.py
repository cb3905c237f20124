"""Graphs after onnxruntime.transformers.optimizer (EmbedLayerNormalization, com.microsoft Attention,
SkipLayerNormalization, BiasGelu): quantized, Attention exported as QAttention, checked in onnxruntime."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

import netquant
from netquant.graph import Executor, load_onnx
from tests.helpers.node_harness import ort_and_ours
from tests.helpers.transformer_models import cosine, ort_fused_batches, ort_fused_bert


def _run(model: onnx.ModelProto | Path, feeds: dict[str, np.ndarray], saved: Path | None = None) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    if saved is not None:
        so.optimized_model_filepath = str(saved)
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_executor_runs_the_fused_graph_like_onnxruntime() -> None:
    model = ort_fused_bert()
    feeds = ort_fused_batches(1, seed=7)[0]
    ours = Executor(load_onnx(model)).run({k: torch.from_numpy(v) for k, v in feeds.items()})["hidden"].numpy()
    np.testing.assert_allclose(ours, _run(model, feeds), atol=1e-4, rtol=1e-4)


def test_attention_weights_quantize_and_run_as_qattention(tmp_path: Path) -> None:
    model = ort_fused_bert()
    qm = netquant.quantize_onnx(model, ort_fused_batches(6), objective=None, quiet=True)
    cfg = qm.qgraph.op_configs["attention"]
    assert cfg.inputs[1] is not None and cfg.inputs[1].is_active  # the packed QKV weights, per column
    assert cfg.inputs[1].params.scale.numel() == 3 * 64
    out = tmp_path / "q.onnx"
    report = qm.export(out)
    assert (report.int8_kernels or {}).get("QAttention") == 1
    saved = tmp_path / "opt.onnx"
    feeds = ort_fused_batches(1, seed=11)[0]
    y = _run(out, feeds, saved)
    ops = Counter(n.op_type for n in onnx.load(str(saved)).graph.node)
    assert ops["QAttention"] == 1 and ops["Attention"] == 0 and ops["DequantizeLinear"] == 0
    assert cosine(y, _run(model, feeds)) > 0.999
    ours = Executor(load_onnx(onnx.load(str(out)))).run({k: torch.from_numpy(v) for k, v in feeds.items()})
    assert cosine(ours["hidden"].numpy(), y) > 0.99999  # the executor runs the exported QAttention file alike


def _qattention_weight(path: Path) -> torch.Tensor:
    proto = onnx.load(str(path))
    inits = {i.name: i for i in proto.graph.initializer}
    node = next(n for n in proto.graph.node if n.op_type == "QAttention")
    return torch.from_numpy(onnx.numpy_helper.to_array(inits[node.input[1]]).copy())


def test_attention_weights_keep_pairs_within_the_int16_limit(tmp_path: Path) -> None:
    """Target 'any' (the default): QAttention's packed QKV weights keep every same-sign pair of the kernel's K order
    within |q0| + |q1| <= 128, as MatMul weights do, so onnxruntime's int16 pair sums on x86 without VNNI never
    saturate; target 'x86-vnni' keeps full-range codes. The executor with the host's accumulation runs the graph
    onnxruntime runs (QAttention, MatMulIntegerToFloat, ...) as onnxruntime does here, and its no-VNNI emulation moves
    the full-range file's output, not the limited one's."""
    from netquant.core.int_kernels import Accumulation, WeightLayout, overflow_pairs
    from netquant.core.int_kernels import LayoutKind as Kind
    from netquant.platforms.targets import host_accumulation

    model = ort_fused_bert()
    feeds = ort_fused_batches(1, seed=11)[0]
    inputs = {k: torch.from_numpy(v) for k, v in feeds.items()}
    moved = {}
    for target in ("any", "x86-vnni"):
        qm = netquant.quantize_onnx(model, ort_fused_batches(6), objective=None, quiet=True, target=target)
        out = qm.export(tmp_path / f"{target}.onnx").path
        over = overflow_pairs(WeightLayout(Kind.ROWS).to_nk(_qattention_weight(out)))
        assert bool(over.any()) is (target == "x86-vnni"), target
        saved = tmp_path / f"{target}_ort.onnx"  # the graph onnxruntime runs: its fused int8 kernels
        engine = _run(out, feeds, saved)
        graph = load_onnx(onnx.load(str(saved)))
        here = Executor(graph, accumulation=host_accumulation()).run(inputs)["hidden"].numpy()
        assert cosine(here, engine) > 0.99999, target
        exact, pairwise = (Executor(graph, accumulation=a).run(inputs)["hidden"].numpy()
                           for a in (Accumulation.EXACT, Accumulation.PAIRWISE_INT16))
        moved[target] = 1 - cosine(exact, pairwise)
    assert moved["any"] < 1e-9 < 1e-7 < moved["x86-vnni"], moved  # (measured: 0 and 7.4e-5)


def test_qattention_node_matches_onnxruntime() -> None:
    from onnx import helper

    rng = np.random.default_rng(3)
    b, s, h, n = 2, 5, 8, 2
    feeds = {"x": rng.integers(0, 256, (b, s, h)).astype(np.uint8),
             "w": rng.integers(-127, 128, (h, 3 * h)).astype(np.int8),
             "bias": rng.standard_normal(3 * h).astype(np.float32),
             "sx": np.array(0.02, np.float32), "sw": (rng.random(3 * h) * 0.01 + 0.001).astype(np.float32),
             "mask": np.array([s, 3], np.int32), "zx": np.array(128, np.uint8), "zw": np.zeros(3 * h, np.int8)}
    node = helper.make_node("QAttention", list(feeds), ["y"], domain="com.microsoft", num_heads=n)
    ref, ours = ort_and_ours(node, feeds, domain_opsets={"com.microsoft": 1})
    np.testing.assert_allclose(ours[0], ref[0], atol=1e-4, rtol=1e-4)


def test_fused_graph_file_has_no_zero_weight_zero_points(tmp_path: Path) -> None:
    """After the optimizer's com.microsoft ops onnx shape inference knows no ranks: export.ranks infers them, so the
    MatMul weights' all-zero zero points are dropped (rank >= 3 inputs), and QAttention leaves its z_w out
    (omitted means 0); onnxruntime's output is unchanged by it (QAttention still runs)."""
    from netquant.export.ranks import RankOf

    model = ort_fused_bert()
    qm = netquant.quantize_onnx(model, ort_fused_batches(6), objective=None, quiet=True)
    rank_of = RankOf(qm.qgraph.graph)
    matmuls = [n for n in qm.qgraph.graph.nodes if n.op_type == "MatMul"]
    assert matmuls and all(qm.qgraph.graph.value(n.inputs[0]).shape is None for n in matmuls)
    assert [rank_of(n.inputs[0]) for n in matmuls] == [3] * len(matmuls)
    out = tmp_path / "q.onnx"
    qm.export(out)
    q = onnx.load(str(out))
    qatt = [n for n in q.graph.node if n.op_type == "QAttention"]
    assert len(qatt) == 1 and len(qatt[0].input) == 7  # input, weight, bias, s_x, s_w, mask, z_x
    int8_zero_points = [t for t in q.graph.initializer if t.data_type == onnx.TensorProto.INT8 and len(t.dims) == 1]
    assert int8_zero_points == []
    feeds = ort_fused_batches(1, seed=11)[0]
    y = _run(out, feeds)
    assert cosine(y, _run(model, feeds)) > 0.999
    ours = Executor(load_onnx(q)).run({k: torch.from_numpy(v) for k, v in feeds.items()})
    assert cosine(ours["hidden"].numpy(), y) > 0.99999
