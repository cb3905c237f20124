"""Reference-semantics presets on the PP-OCR recognizer (the model that exposed their defaults): exact-line accuracy
of netquant's fake-quant (the Q/DQ reference semantics these platforms are checked in) on 200 held-out rendered
lines, 64 calibration lines, placement off (the platform's defaults alone). FP32: 97.5%.

Slow (each calibrates the real recognizer, ~1 min): `pytest -m slow tests/platforms/test_rec_presets.py`.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import netquant


@pytest.fixture(scope="module")
def rec_task():
    from netquant.api import zoo
    from netquant.data.ocr import ctc_greedy_decode, rec_batch, score_lines
    from netquant.data.text_render import make_text_lines

    calib_lines, eval_lines = make_text_lines(64, seed=1000), make_text_lines(200, seed=2000)
    xc, xe = rec_batch(calib_lines), rec_batch(eval_lines)
    truth, dictionary = [line.text for line in eval_lines], zoo.ppocr_rec_dictionary()

    def accuracy(qm, fake_quant: bool = True) -> float:
        outs = [next(iter(qm.run({"x": xe[i:i + 25]}, fake_quant=fake_quant).values())).numpy()
                for i in range(0, len(xe), 25)]
        return score_lines(ctc_greedy_decode(np.concatenate(outs), dictionary), truth).line_acc

    calib = [{"x": xc[i:i + 8]} for i in range(0, len(xc), 8)]
    return zoo.ppocr_model_path("rec"), calib, accuracy


def _quantize(rec_task, platform: str, **settings: object):
    path, calib, _ = rec_task
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return netquant.quantize_onnx(str(path), calib, platform=platform, quiet=True, objective=None, **settings)


# (platform, settings, lowest accuracy): measured 97.0% (academic), 95.0% (qnn); before: 0% and 55%
CASES = [
    ("academic_int8", {}, 0.965),
    ("qnn_dsp", {}, 0.94),
]


@pytest.mark.slow
@pytest.mark.parametrize(("platform", "settings", "lowest"), CASES)
def test_reference_preset_on_the_recognizer(rec_task, platform, settings, lowest):
    qm = _quantize(rec_task, platform, **settings)
    accuracy = rec_task[2]
    assert accuracy(qm, fake_quant=False) == pytest.approx(0.975)  # FP32 (bias correction restored in FP32 runs)
    assert accuracy(qm) >= lowest


@pytest.mark.slow
def test_bias_correction_rescues_per_tensor_academic_weights(rec_task):
    """PPQ's own per-tensor weights: 0% exact lines without bias correction, about 90% with it."""
    accuracy = rec_task[2]
    assert accuracy(_quantize(rec_task, "academic_int8", per_channel=False, bias_correction=False)) < 0.1
    assert accuracy(_quantize(rec_task, "academic_int8", per_channel=False)) > 0.85


# (platform, lowest accuracy, most float regions) with placement on (the default BALANCED budget): the platform's
# wider format first. Measured: qnn_dsp 14 regions uint16 activations, none float, 97.5% (94.0% before: the budget
# floated nothing); academic_int4 all 38 regions int8 (W8A8), none float, 97.5% (before: 37 of 38 float)
WIDER_CASES = [("qnn_dsp", 0.965, 0), ("academic_int4", 0.965, 0)]


@pytest.mark.slow
@pytest.mark.parametrize(("platform", "lowest", "most_float"), WIDER_CASES)
def test_placement_widens_before_floating_on_the_recognizer(rec_task, platform, lowest, most_float):
    path, calib, accuracy = rec_task
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_onnx(str(path), calib, platform=platform, quiet=True)
    summary = qm.placement.summary()
    assert summary["wider_regions"] > 0 and summary["float_regions"] <= most_float
    assert accuracy(qm) >= lowest
