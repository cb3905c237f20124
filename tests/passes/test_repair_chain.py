"""The repair passes together (equalization -> SmoothQuant -> AdaRound, each at its stage): the same file bytes
twice, the FP32 model unchanged, every pass recorded in order; and under placement (the default objective)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

import netquant
from netquant.passes.adaround import AdaRoundPass
from netquant.passes.equalization import EqualizationPass
from netquant.passes.smoothquant import SmoothQuantPass
from tests.helpers.repair_models import cnn_inputs, cnn_model


def chain() -> list:
    # AdaRound given first runs at its own stage (after bias quantization); within a stage the given order holds
    return [AdaRoundPass(iterations=20), EqualizationPass(), SmoothQuantPass()]


def test_the_chain_is_deterministic_and_exact_in_fp32(tmp_path):
    model = cnn_model()
    calib = [cnn_inputs(8, s) for s in range(3)]
    x = cnn_inputs(8, 9)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for i in range(2):
        q = netquant.quantize_onnx(model, calib, "academic_int8", passes=chain(), objective=None, quiet=True)
        q.export(tmp_path / f"m{i}.onnx")
        q.export(tmp_path / f"p{i}.json", format="json")
        order = [r.repair for r in q.qgraph.repairs]
        assert order == sorted(order, key=["equalization", "smoothquant", "adaround"].index) and "adaround" in order
        fp32 = q.run({"x": x}, fake_quant=False)["y"].numpy()
        assert float(np.abs(fp32 - ref).max() / np.abs(ref).max()) <= 1e-5
    assert (tmp_path / "m0.onnx").read_bytes() == (tmp_path / "m1.onnx").read_bytes()
    assert _params(tmp_path / "p0.json") == _params(tmp_path / "p1.json")
    assert json.loads((tmp_path / "p0.json").read_text())["repairs"][0]["repair"] == "equalization"


def test_the_chain_under_placement():
    model = cnn_model()
    calib = [cnn_inputs(8, s) for s in range(3)]
    q = netquant.quantize_onnx(model, calib, "onnxruntime_int8", passes=chain(), quiet=True, placement_time_s=1.0)
    x = cnn_inputs(4, 9)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    out = q.run({"x": x})["y"].numpy()
    assert float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) < 0.1
    assert q.qgraph.repairs


def _params(path: Path) -> dict:
    """The quant-params JSON without its engine measurements (vs_fp32 holds timings, which vary run to run)."""
    data = json.loads(path.read_text())
    data.pop("vs_fp32", None)
    return data
