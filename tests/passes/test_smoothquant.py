"""SmoothQuant (passes.smoothquant): exact in FP32 (netquant's executor and onnxruntime), lowers the fake-quant
output error where activations have outlier channels, recorded in the quant-params JSON, deterministic."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from onnx import numpy_helper

import netquant
from netquant.graph import to_onnx
from netquant.graph.executor import Executor
from netquant.passes.smoothquant import SmoothQuantPass
from tests.helpers.repair_models import (
    cnn_inputs,
    cnn_model,
    ort_run,
    rel,
    run_passes_alone,
    transformer_inputs,
    transformer_model,
)

smoothed = run_passes_alone


@pytest.mark.parametrize("case", ["transformer", "cnn"])
def test_smoothing_is_exact_in_fp32(case):
    model, make = (transformer_model(), transformer_inputs) if case == "transformer" else (cnn_model(), cnn_inputs)
    calib = [make(8, s) for s in range(3)]
    x = make(16, 50)
    sq = SmoothQuantPass(min_gain=-1.0, insert_mul=True)  # every site smoothed: the exactness of each fold
    graph, ctx = smoothed(model, calib, sq)
    assert ctx.repairs and all(r.alpha is not None for r in sq.results)
    folds = {r.folded for r in sq.results}
    assert "producer" in folds and (case == "transformer" or "mul" in folds)
    ref = ort_run(model, x)
    ours = Executor(graph).run({"x": torch.from_numpy(x)})
    theirs = ort_run(to_onnx(graph), x)
    for out, r, t in zip(model.graph.output, ref, theirs):
        assert rel(ours[out.name].numpy(), r) <= 1e-5
        assert rel(t, r) <= 1e-5
    # the weights really changed (the LayerNorm absorbed 1 / s, the readers s)
    if case == "transformer":
        g1 = graph.initializers[graph.node("ln1").inputs[1]].numpy()
        original = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "g1"))
        assert np.abs(g1 / original).max() > 2 * np.abs(g1 / original).min()


def test_smoothquant_lowers_the_output_error_of_outlier_channels():
    model = transformer_model()
    calib = [transformer_inputs(8, s) for s in range(4)]
    x = transformer_inputs(32, 99)
    ref = ort_run(model, x)
    errs = {}
    for label, passes in (("plain", []), ("smooth", [SmoothQuantPass()])):
        q = netquant.quantize_onnx(model, calib, "onnxruntime_int8", passes=passes, objective=None, quiet=True)
        out = q.run({"x": x})
        errs[label] = [float(np.linalg.norm(out[o.name].numpy() - r) / np.linalg.norm(r))
                       for o, r in zip(model.graph.output, ref)]
    # both outputs: the LayerNorm's 3 outlier channels (x40) set the per-tensor scale of its readers' input
    for before, after in zip(errs["plain"], errs["smooth"]):
        assert after < 0.6 * before
    # the layer that reads the outlier tensor: searched strength and a lower error than no smoothing
    graph, ctx = smoothed(model, calib, sq := SmoothQuantPass())
    first = next(r for r in sq.results if r.tensor == "ln1")
    assert first.alpha is not None and 0.0 < first.alpha < 1.0
    assert first.error_after < 0.5 * first.error_before


def test_smoothquant_is_recorded_and_deterministic(tmp_path):
    model = transformer_model()
    calib = [transformer_inputs(8, s) for s in range(3)]
    files = []
    for i in range(2):
        q = netquant.quantize_onnx(model, calib, "onnxruntime_int8", passes=[SmoothQuantPass()], objective=None,
                                   quiet=True)
        files.append(q.export(tmp_path / f"m{i}.onnx"))
        q.export(tmp_path / f"p{i}.json", format="json")
    assert (tmp_path / "m0.onnx").read_bytes() == (tmp_path / "m1.onnx").read_bytes()
    params = json.loads((tmp_path / "p0.json").read_text())
    repairs = params["repairs"]
    assert {r["tensor"] for r in repairs} >= {"ln1", "ln2"}
    assert all(r["repair"] == "smoothquant" and 0.0 <= r["alpha"] <= 1.0 and r["error_after"] < r["error_before"]
               for r in repairs)
    assert _params(tmp_path / "p0.json") == _params(tmp_path / "p1.json")


def _params(path: Path) -> dict:
    """The quant-params JSON without its engine measurements (vs_fp32 holds timings, which vary run to run)."""
    data = json.loads(path.read_text())
    data.pop("vs_fp32", None)
    return data
