"""MatMul input ranges (passes.matmul_ranges): on a BERT-style encoder (zoo.bert_module, width 384) the clipped
ranges of the LayerNorm / GELU outputs read by MatMuls lower the quantized model's output error in onnxruntime;
placement keeps them only where its budget's loss is lower (analysis.placement.ranges); recorded and deterministic."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.api import zoo
from netquant.passes.matmul_ranges import CLIPS, NAME
from tests.helpers.ir import make_model

CFG = {"layers": 2, "dim": 384, "heads": 12, "ff": 1536, "vocab": 512}
SEQ = 64


def _batches(n: int, seed: int) -> list[dict[str, np.ndarray]]:
    return [zoo.bert_inputs(1, SEQ, seed=seed + i, vocab=CFG["vocab"]) for i in range(n)]


def _outputs(path, feeds: list[dict[str, np.ndarray]]) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run(None, f)[0].ravel() for f in feeds]).astype(np.float64)


def _one_minus_cos(a: np.ndarray, b: np.ndarray) -> float:
    return 1.0 - float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="module")
def encoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("matmul_ranges")
    path = folder / "bert.onnx"
    zoo.export_bert(zoo.bert_module(**CFG, seed=0), path, None)
    calib = _batches(16, 0)
    out = {}
    for on in (False, True):
        q = netquant.quantize_onnx(str(path), calib, objective=None, quiet=True, matmul_ranges=on, embeddings=False)
        q.export(folder / f"{on}.onnx")
        q.export(folder / f"{on}.json", format="json")
        out[on] = q
    return path, calib, out, folder


def test_clipped_ranges_lower_the_output_error_in_onnxruntime(encoder):
    path, _, out, folder = encoder
    evals = _batches(8, 100)  # held out
    ref = _outputs(path, evals)
    loss = {on: _one_minus_cos(ref, _outputs(folder / f"{on}.onnx", evals)) for on in out}
    # measured: 1 - cos 1.399e-05 (min / max) -> 1.317e-05 (clipped), onnxruntime 1.32 on x86-64 (VNNI)
    assert loss[True] < 0.98 * loss[False]
    chosen = [dict(r.values) for r in out[True].qgraph.repairs if r.repair == NAME]
    assert chosen and all(v["clip"] in CLIPS and v["clip"] < 1.0 and v["error_after"] < v["error_before"]
                          for v in chosen)
    # LayerNorm outputs (the fused QKV and the first feed-forward MatMul read them) among the clipped tensors
    assert any("LayerNormalization" in v["tensor"] or "norm" in v["tensor"] for v in chosen)
    assert not [r for r in out[False].qgraph.repairs if r.repair == NAME]
    assert len(out[True].qgraph.clipped_ranges) == len(chosen)


def test_clipped_ranges_are_recorded_and_deterministic(encoder, tmp_path):
    path, calib, out, folder = encoder
    params = json.loads((folder / "True.json").read_text())
    recorded = [r for r in params["repairs"] if r["repair"] == NAME]
    assert len(recorded) == len(out[True].qgraph.clipped_ranges) > 0
    again = netquant.quantize_onnx(str(path), calib, objective=None, quiet=True, matmul_ranges=True, embeddings=False)
    again.export(tmp_path / "again.onnx")
    assert (tmp_path / "again.onnx").read_bytes() == (folder / "True.onnx").read_bytes()


def test_calibrations_kept_tensors_give_the_choice_of_a_run_of_its_own(encoder, tmp_path, monkeypatch):
    """With one torch thread calibration keeps the searched tensors of the later validation batches and the pass
    runs no executor of its own; kept or not (RANGE_KEEP_BYTES 0), the same clipped ranges, the same file."""
    from netquant.passes import calibration, matmul_ranges
    from netquant.platforms.threads import thread_scope

    path, calib, out, folder = encoder
    built: list[int] = []

    class Counted(matmul_ranges.Executor):  # type: ignore[misc,valid-type]
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(matmul_ranges, "Executor", Counted)
    files = {}
    for keep in (calibration.RANGE_KEEP_BYTES, 0):
        monkeypatch.setattr(calibration, "RANGE_KEEP_BYTES", keep)
        built.clear()
        with thread_scope(1):
            q = netquant.quantize_onnx(str(path), calib, objective=None, quiet=True, matmul_ranges=True,
                                       embeddings=False)
        assert len(built) == (0 if keep else 1) and q.qgraph.range_tensors == {}
        q.export(tmp_path / f"{keep}.onnx")
        files[keep] = (tmp_path / f"{keep}.onnx").read_bytes()
        assert [(c.tensor, c.clipped) for c in q.qgraph.clipped_ranges] == \
            [(c.tensor, c.clipped) for c in out[True].qgraph.clipped_ranges]
    assert files[0] == files[calibration.RANGE_KEEP_BYTES] == (folder / "True.onnx").read_bytes()


def test_placement_keeps_clipped_ranges_only_where_its_loss_is_lower(encoder):
    path, calib, _, _ = encoder
    q = netquant.quantize_onnx(str(path), calib, quiet=True, matmul_ranges=True, embeddings=False)
    m = q.placement.measured["matmul_ranges"]
    assert m["tensors"] > 0 and m["kept"] == (m["loss_clipped"] < m["loss_min_max"])
    assert bool(q.qgraph.clipped_ranges) == m["kept"]
    # the budget's all-INT8 loss is the one of the ranges kept
    assert q.placement.measured["loss_all_int8"] == min(m["loss_clipped"], m["loss_min_max"])


def feed_forward_block(seed: int = 0):
    """x[N, 16, 64] -> LayerNorm -> MatMul [64, 256] + bias -> erf GELU -> MatMul [256, 64] + bias -> + x: a block
    whose local clipping the budget's loss rejects (the GELU passes a large value's clipping error)."""
    k = 64
    rng = np.random.default_rng(seed)
    inits = [numpy_helper.from_array(np.asarray(v, np.float32), n) for n, v in {
        "g": rng.uniform(0.8, 1.2, k), "b": rng.normal(0, 0.1, k), "w1": rng.normal(0, 1 / np.sqrt(k), (k, 4 * k)),
        "b1": rng.normal(0, 0.1, 4 * k), "w2": rng.normal(0, 1 / np.sqrt(4 * k), (4 * k, k)),
        "b2": rng.normal(0, 0.1, k), "half": 0.5, "one": 1.0, "rsqrt2": 1 / np.sqrt(2)}.items()]
    nodes = [helper.make_node("LayerNormalization", ["x", "g", "b"], ["ln"], name="ln", axis=-1),
             helper.make_node("MatMul", ["ln", "w1"], ["h0"], name="fc1"),
             helper.make_node("Add", ["h0", "b1"], ["h1"], name="fc1_bias"),
             helper.make_node("Mul", ["h1", "rsqrt2"], ["h2"], name="gelu_scale"),
             helper.make_node("Erf", ["h2"], ["h3"], name="gelu_erf"),
             helper.make_node("Add", ["h3", "one"], ["h4"], name="gelu_add"),
             helper.make_node("Mul", ["h1", "h4"], ["h5"], name="gelu_mul"),
             helper.make_node("Mul", ["h5", "half"], ["gelu"], name="gelu_half"),
             helper.make_node("MatMul", ["gelu", "w2"], ["o0"], name="fc2"),
             helper.make_node("Add", ["o0", "b2"], ["o1"], name="fc2_bias"),
             helper.make_node("Add", ["o1", "x"], ["y"], name="residual")]
    graph = helper.make_graph(nodes, "ffn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16, k])], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_rejected_clipped_ranges_stay_rejected_from_the_placement_file(tmp_path):
    model = feed_forward_block()
    calib = [np.random.default_rng(s).normal(0, 1, (4, 16, 64)).astype(np.float32) for s in range(16)]
    q = netquant.quantize_onnx(model, calib, quiet=True, matmul_ranges=True)
    m = q.placement.measured["matmul_ranges"]
    # measured: the budget's loss 5.14e-05 clipped vs 4.96e-05 min / max: the min / max ranges stay
    assert m["tensors"] >= 1 and m["kept"] is False and m["loss_clipped"] > m["loss_min_max"]
    assert not q.qgraph.clipped_ranges and not [r for r in q.qgraph.repairs if r.repair == NAME]
    plain = netquant.quantize_onnx(model, calib, objective=None, quiet=True, matmul_ranges=False)
    scale = {name: oc.inputs[0].params.scale for name, oc in plain.qgraph.op_configs.items() if name in ("fc1", "fc2")}
    q.save_placement(tmp_path / "p.json")
    again = netquant.quantize_onnx(model, calib, quiet=True, matmul_ranges=True, placement_from=tmp_path / "p.json")
    for qm in (q, again):
        for name, s in scale.items():
            assert torch.equal(qm.qgraph.op_configs[name].inputs[0].params.scale, s)


def test_only_layernorm_and_gelu_outputs_are_searched(encoder):
    _, _, out, _ = encoder
    from netquant.passes.matmul_ranges import after_norm_or_gelu

    q = out[True]
    graph = q.qgraph.graph
    clipped = {c.tensor for c in q.qgraph.clipped_ranges}
    assert clipped and all(after_norm_or_gelu(graph, t) for t in clipped)
    # the attention context read by the output projection (MatMul -> Transpose -> Reshape) is not a candidate
    contexts = [n.inputs[0] for n in graph.nodes if n.op_type == "MatMul" and n.name.endswith("out/MatMul")]
    assert contexts and not any(after_norm_or_gelu(graph, t) for t in contexts)
