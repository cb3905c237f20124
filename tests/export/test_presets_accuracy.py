"""The presets for engines that do not run here keep the PP-OCR classifier within 1 point of FP32 in the reference
Q/DQ semantics: the exported file run in onnxruntime with graph optimizations off (Q/DQ as ONNX defines them).

Slow (each preset calibrates the real classifier): `pytest -m slow tests/export/test_presets_accuracy.py`.
academic_int4 is not among them: 4-bit activations lose the classifier (90.0% with the budget, 63% without;
benchmarks/results/engine_matrix.md).
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import netquant
from netquant.export.onnx_qdq import REFERENCE_ONLY_NOTE

REFERENCE_PRESETS = ["tensorrt_int8", "qnn_dsp", "fp8_e4m3", "academic_int8", "pow2_int8"]


def _reference_session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def cls_data():
    from netquant.api import zoo
    from netquant.data.ocr import cls_batch, direction_samples
    from netquant.data.text_render import make_text_lines

    calib = cls_batch([s.image for s in direction_samples(make_text_lines(64, seed=1000))])
    held_out = direction_samples(make_text_lines(200, seed=2000))
    x, labels = cls_batch([s.image for s in held_out]), np.array([s.label for s in held_out])
    fp32 = zoo.ppocr_model_path("cls")
    return fp32, [{"x": calib[i:i + 8]} for i in range(0, len(calib), 8)], x, labels


def _accuracy(sess: ort.InferenceSession, x: np.ndarray, labels: np.ndarray) -> float:
    probs = np.concatenate([sess.run(None, {"x": x[i:i + 16]})[0] for i in range(0, len(x), 16)])
    return float((probs.argmax(1) == labels).mean())


@pytest.mark.slow
@pytest.mark.parametrize("platform", REFERENCE_PRESETS)
def test_preset_keeps_the_classifier_within_one_point_in_reference_semantics(platform: str, cls_data,
                                                                           tmp_path: Path) -> None:
    fp32, calib, x, labels = cls_data
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_onnx(str(fp32), calib, platform=platform, quiet=True)
    path = tmp_path / f"cls_{platform}.onnx"
    report = qm.export(path)
    assert report.reference_only and report.validated_with.startswith("Q/DQ reference")
    assert REFERENCE_ONLY_NOTE in report.summary()
    base = _accuracy(_reference_session(fp32), x, labels)
    got = _accuracy(_reference_session(path), x, labels)
    assert got >= base - 0.01, f"{platform}: {got:.4f} vs FP32 {base:.4f}"
