"""export.dynamic: MatMul regions with the activation quantized at run time, checked in onnxruntime and the executor."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import netquant
from netquant.export.dynamic import make_dynamic
from netquant.export.onnx_qdq import build_qdq_model
from netquant.graph import Executor, load_onnx
from tests.helpers.ort_sessions import one_thread_session as _session
from tests.helpers.transformer_models import SMALL, cosine, small_bert, small_bert_batches


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, netquant.QuantizedModel]:
    path = small_bert(tmp_path_factory.mktemp("bert") / "bert.onnx", seq=32)
    return path, netquant.quantize_onnx(str(path), small_bert_batches(4), objective=None, quiet=True)


def _linears(q: netquant.QuantizedModel) -> list[str]:
    g = q.qgraph.graph
    return [n.name for n in g.nodes if n.op_type == "MatMul" and n.inputs[1] in g.initializers]


def test_every_linear_becomes_dynamic_and_onnxruntime_fuses_it(bert: tuple[Path, netquant.QuantizedModel],
                                                               tmp_path: Path) -> None:
    path, q = bert
    static = build_qdq_model(q.qgraph)[0]
    model = onnx.ModelProto()
    model.CopyFrom(static)
    linears = _linears(q)
    assert sorted(make_dynamic(model, linears)) == sorted(linears) and len(linears) == 4 * SMALL["layers"]
    onnx.checker.check_model(model, full_check=True)
    ops = Counter(n.op_type for n in model.graph.node)
    assert ops["DynamicQuantizeLinear"] == ops["MatMulInteger"] == len(linears)
    assert ops["QuantizeLinear"] == ops["DequantizeLinear"] == 0  # no static Q/DQ is left
    saved = tmp_path / "opt.onnx"
    sess = _session(model, saved=saved)
    fused = Counter(n.op_type for n in onnx.load(str(saved)).graph.node)
    assert fused["DynamicQuantizeMatMul"] + fused["MatMulIntegerToFloat"] == len(linears)
    assert fused["MatMul"] == 2 * SMALL["layers"] - fused["FusedMatMul"]  # only the attention products stay float
    feeds = small_bert_batches(1, seed=30)[0]
    ref = _session(path).run(None, feeds)[0]
    assert cosine(sess.run(None, feeds)[0], ref) > 0.999


def test_executor_runs_the_dynamic_file_like_onnxruntime(bert: tuple[Path, netquant.QuantizedModel]) -> None:
    _, q = bert
    model = build_qdq_model(q.qgraph)[0]
    make_dynamic(model, _linears(q))
    feeds = small_bert_batches(1, seed=31)[0]
    ours = Executor(load_onnx(model)).run({k: torch.from_numpy(v) for k, v in feeds.items()})["hidden"].numpy()
    theirs = _session(model, optimized=False).run(None, feeds)[0]  # the ONNX reference semantics
    np.testing.assert_allclose(ours, theirs, atol=2e-4, rtol=1e-4)
    fused = _session(model).run(None, feeds)[0]  # and the fused kernels (exact int32 accumulation here)
    assert cosine(ours, fused) > 0.99999


def test_only_qdq_matmuls_are_rewritten(bert: tuple[Path, netquant.QuantizedModel]) -> None:
    _, q = bert
    model = build_qdq_model(q.qgraph)[0]
    attention = [n.name for n in model.graph.node if n.op_type == "MatMul"
                 and not any(n.input[1].endswith(s) for s in ("DequantizeLinear_Output",))]
    assert attention and make_dynamic(model, attention) == []  # float x float products stay as they are
    assert make_dynamic(model, ["no such node"]) == []


def test_dynamic_ops_reach_the_export(bert: tuple[Path, netquant.QuantizedModel], tmp_path: Path) -> None:
    _, q = bert
    first = _linears(q)[:3]
    q.qgraph.dynamic_ops = set(first)
    try:
        report = q.export(tmp_path / "mixed.onnx")
    finally:
        q.qgraph.dynamic_ops = set()
    kernels = report.int8_kernels or {}
    assert kernels.get("DynamicQuantizeMatMul", 0) + kernels.get("MatMulIntegerToFloat", 0) == len(_linears(q))
    assert kernels.get("DynamicQuantizeLinear", 0) == 0  # fused away
    model = onnx.load(str(tmp_path / "mixed.onnx"))
    assert sorted(n.name for n in model.graph.node if n.op_type == "MatMulInteger") == sorted(first)
    assert report.quantize_nodes == len(_linears(q)) - len(first)
