"""analysis.placement.repair: repair before float on the PP-OCR direction classifier (the rapidocr wheel's model,
rendered text lines), measured with the fake-quant loss and checked in onnxruntime."""

from __future__ import annotations

import json
import re
import time
import warnings

import numpy as np
import onnxruntime as ort
import pytest

from netquant.analysis.placement import Placement, Reason, search_placement
from netquant.api import quantize_onnx, zoo
from netquant.data.ocr import cls_batch, direction_samples
from netquant.data.text_render import make_text_lines
from netquant.passes.settings import Objective, QuantSettings


@pytest.fixture(scope="module")
def cls_case():
    path = zoo.ppocr_model_path("cls")
    images = cls_batch([s.image for s in direction_samples(make_text_lines(32, seed=1000))])
    return str(path), [{"x": images[i:i + 8]} for i in range(0, len(images), 8)]


@pytest.fixture(scope="module")
def budget(cls_case) -> float:
    """A budget between this machine's plain all-INT8 loss and its loss with equalization, so that equalization alone
    meets it: the losses move with the machine (AMD EPYC, Pillow 13: 3.14e-4 plain, 1.18e-4 with equalization; an
    AVX-512 Xeon with torch 2.11: 5.1e-5 plain, on lines rendered by its Pillow). Measured with a budget no repair
    meets, so every repair is tried and recorded."""
    probe = _q(cls_case, max_loss=1e-9, effort="default", placement_time_s=1e-3).placement
    eq = next((r for r in probe.repairs if r.repair == "equalization"), None)
    if eq is None or not eq.loss_after < eq.loss_before:
        pytest.skip(f"equalization does not lower this machine's all-INT8 loss on these lines ({probe.repairs})")
    return (eq.loss_before + eq.loss_after) / 2


def _q(case, **kw):
    path, calib = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the classifier's bias-overflow notes
        return quantize_onnx(path, calib, quiet=True, **kw)


def _budget_floats(p: Placement) -> set[str]:
    return {r.anchor for r in p.regions if r.decision == "float" and r.reason == Reason.BUDGET}


def _ort_cosine(qm, case, tmp_path) -> float:
    path, calib = case
    out = qm.export(tmp_path / "m.onnx").path
    x = calib[0]
    ref = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, x)[0].ravel()
    got = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, x)[0].ravel()
    return float(ref @ got / np.linalg.norm(ref) / np.linalg.norm(got))


def test_repair_before_float_keeps_every_region_int8(cls_case, budget, tmp_path):
    """Over the budget in plain INT8, effort 'default' tries equalization first; it brings the loss within the
    budget, so nothing floats for accuracy; effort 'fast' (no repair) floats regions instead."""
    qm = _q(cls_case, max_loss=budget, effort="default")
    p = qm.placement
    assert [r.repair for r in p.repairs] == ["equalization"]
    eq = p.repairs[0]
    assert eq.kept and eq.loss_before > budget >= eq.loss_after and eq.seconds > 0
    assert eq.loss_after == pytest.approx(p.measured["loss_all_int8"], rel=1e-4)  # the placed model is the repaired one
    assert not _budget_floats(p)
    s = qm.summary()["placement"]
    assert s["repair"] == "equalization" and s["repairs"][0]["loss_after"] == eq.loss_after
    assert "equalization (model): loss" in p.markdown()
    assert _ort_cosine(qm, cls_case, tmp_path) > 0.999

    fast = _q(cls_case, max_loss=budget, effort="fast").placement
    assert fast.repairs == [] and fast.measured["loss_all_int8"] == pytest.approx(eq.loss_before, rel=1e-4)
    assert _budget_floats(fast)  # without repair the budget floats regions


def test_placement_file_records_and_reapplies_the_repair(cls_case, budget, tmp_path):
    qm = _q(cls_case, max_loss=budget)
    path = qm.save_placement(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["repairs"][0]["repair"] == "equalization" and data["repairs"][0]["kept"] is True
    again = _q(cls_case, placement_from=str(path))
    assert again.placement.kept_repair() == "equalization"
    assert again.placement.float_anchors() == qm.placement.float_anchors()
    a, b = qm.export(tmp_path / "a.onnx"), again.export(tmp_path / "b.onnx")
    assert a.path.read_bytes() == b.path.read_bytes()  # the same repaired weights, the same placement


@pytest.mark.slow
def test_accuracy_decisions_do_not_follow_threads_or_the_time_cap(cls_case):
    """The same model, data and seed under 1 and 2 torch threads, with a generous and a vanishing time cap (a
    machine so slow that every latency measurement overruns it): the same repairs with the same losses, the same
    regions floated for the budget, the same all-INT8 loss. Only latency choices may differ."""
    runs = [_q(cls_case, max_loss=1e-4, threads=1, placement_time_s=30.0).placement,
            _q(cls_case, max_loss=1e-4, threads=2, placement_time_s=1e-3).placement]
    a, b = runs
    assert [(r.repair, r.loss_before, r.loss_after, r.kept) for r in a.repairs] == \
        [(r.repair, r.loss_before, r.loss_after, r.kept) for r in b.repairs]
    assert a.repairs and _budget_floats(a)  # the budget needed both repair and floats: a real decision
    assert _budget_floats(a) == _budget_floats(b)
    assert a.measured["loss_all_int8"] == b.measured["loss_all_int8"]
    assert "time cap 0.00 s reached" in b.note


def test_time_cap_note_states_the_time_really_taken(cls_case):
    """The note's 'placement took Y s' is placement's wall time (QuantizedModel.timings['placement'])."""
    t = time.perf_counter()
    qm = _q(cls_case, placement_time_s=0.05)
    wall = time.perf_counter() - t
    p = qm.placement
    m = re.search(r"time cap ([0-9.]+) s reached: placement took ([0-9.]+) s in all", p.note)
    assert m is not None, p.note
    assert float(m.group(1)) == pytest.approx(p.measured["time_cap_s"], abs=0.006)
    took = float(m.group(2))
    assert took == pytest.approx(p.measured["seconds"], abs=0.006)
    assert took == pytest.approx(qm.timings["placement"], abs=0.25)
    assert took > float(m.group(1)) and took <= wall


@pytest.mark.slow
def test_budget_floats_the_region_whose_measured_gain_is_largest(cls_case):
    """The budget ranks regions by their measured gain (the loss floating each saves vs all INT8), not by a proxy:
    with a budget that one float can meet, effort 'max' (every region measured) floats exactly the region whose
    report gain is the largest."""
    def plain_graph():
        return _q(cls_case, objective=None).qgraph

    first = search_placement(plain_graph(), _settings(max_loss=1.0, effort="max"), time_budget_s=60.0)
    gains = {r.anchor: r.gain for r in first.regions}
    assert all(g is not None for g in gains.values())
    best = max(gains, key=lambda a: (gains[a], a))
    budget = first.measured["loss_all_int8"] - 0.5 * gains[best]
    p = search_placement(plain_graph(), _settings(max_loss=budget, effort="max"), time_budget_s=60.0)
    assert _budget_floats(p) == {best}
    assert p.measured["loss_placed"] <= budget


def _settings(**kw):
    return QuantSettings.from_kwargs("onnxruntime_int8", {"objective": "accuracy", **kw})


def test_cli_effort_chooses_the_repairs_tried(tmp_path):
    """--effort fast: no repair; default: equalization, then bias correction (off on onnxruntime_int8), each
    recorded with its losses in the placement file, none kept where none lowers the loss below the plain one's."""
    import onnx
    from click.testing import CliRunner

    from netquant.cli.main import cli
    from tests.helpers.placement_models import conv_stack, stack_batches

    model = tmp_path / "m.onnx"
    onnx.save(conv_stack(), str(model))
    np.save(tmp_path / "calib.npy", np.concatenate(stack_batches()))
    files = {}
    for effort in ("fast", "default"):
        place = tmp_path / f"{effort}.json"
        res = CliRunner().invoke(cli, ["quantize", str(model), "--calib", str(tmp_path / "calib.npy"), "-o",
                                       str(tmp_path / f"{effort}.onnx"), "--max-loss", "0", "--effort", effort,
                                       "--placement", str(place), "--allow-float", "--quiet"])
        assert res.exit_code == 0, res.output
        files[effort] = json.loads(place.read_text())
    assert "repairs" not in files["fast"]
    tried = files["default"]["repairs"]
    assert [r["repair"] for r in tried] == ["equalization", "bias correction"]
    plain = tried[0]["loss_before"]
    assert plain > 0 and all(r["loss_before"] == plain and r["loss_after"] > 0 for r in tried)
    assert [r["kept"] for r in tried] == [r["loss_after"] == min(x["loss_after"] for x in tried)
                                          and r["loss_after"] < plain for r in tried]
    res = CliRunner().invoke(cli, ["quantize", str(model), "--calib", "random", "-o", str(tmp_path / "x.onnx"),
                                   "--effort", "huge"])
    assert res.exit_code != 0 and "huge" in res.output


@pytest.mark.slow
def test_effort_max_tries_smoothquant_and_adaround_after_the_cheap_repairs(cls_case):
    """effort 'max': the cheap repairs first, then SmoothQuant, AdaRound and the chain, until one is within the
    budget; the lowest loss ships where none is, and it is the loss the placement measures in all INT8."""
    p = _q(cls_case, max_loss=1e-4, effort="max").placement
    names = [r.repair for r in p.repairs]
    assert names == ["equalization", "bias correction", "smoothquant", "adaround",
                     "equalization + smoothquant + adaround"][:len(names)] and len(names) >= 3
    kept = [r for r in p.repairs if r.kept]
    assert len(kept) == 1 and kept[0].loss_after == min(r.loss_after for r in p.repairs) < kept[0].loss_before
    assert kept[0].loss_after == pytest.approx(p.measured["loss_all_int8"], rel=1e-4)
    assert (kept[0].loss_after <= 1e-4) == (names[-1] == kept[0].repair and not _budget_floats(p))


def test_the_budget_reuses_the_all_int8_loss_try_repairs_measured(cls_case):
    """try_repairs' meter and all-INT8 loss of the plain graph serve the AccuracyBudget of that graph (one meter, one
    pass fewer): the loss is bit-identical to a fresh meter's, and it is not reused for another settings object or
    once the graph's quantization state changed."""
    from netquant.analysis.placement.budget import (
        AccuracyBudget,
        loss_meter,
        measure_all_int8,
        meter_loss,
        take_all_int8,
    )
    from netquant.analysis.placement.measure import SearchState

    q = _q(cls_case, objective=None).qgraph
    settings = _settings(max_loss=1.0)
    fresh = meter_loss(loss_meter(q, settings), [])
    assert measure_all_int8(q, settings) == fresh > 0
    assert take_all_int8(q, _settings(max_loss=1.0)) is None  # another settings object: not taken, slot emptied
    assert take_all_int8(q, settings) is None
    measure_all_int8(q, settings)
    budget = AccuracyBudget(SearchState(q, settings, time.perf_counter() + 60.0), 1.0, Objective.ACCURACY)
    assert budget.meter is not None and budget.meter.calls == 1  # the kept meter: no second pass
    assert budget.loss(set()) == fresh
    measure_all_int8(q, settings)
    q.dynamic_ops = {next(iter(q.op_configs))}  # a changed quantization state: measured again
    try:
        assert take_all_int8(q, settings) is None
    finally:
        q.dynamic_ops = set()


def test_placement_with_repairs_tried_records_the_plain_loss(cls_case):
    """effort 'default' under a budget the plain model meets: one loss pass for the all-INT8 loss (try_repairs'),
    the same loss a fresh meter gives."""
    from netquant.analysis.placement.budget import loss_meter, meter_loss

    qm = _q(cls_case, max_loss=1.0, effort="default")
    p = qm.placement
    assert p.repairs == []
    plain = _q(cls_case, objective=None).qgraph
    assert p.measured["loss_all_int8"] == pytest.approx(meter_loss(loss_meter(plain, _settings(max_loss=1.0)), []),
                                                        rel=1e-5)


def _tiny_file_naming(tmp_path, repair: str):
    """A placement file of the tiny conv_relu_gemm model whose record says it shipped with `repair` kept."""
    from tests.helpers.onnx_models import calib_batches, conv_relu_gemm

    batches = calib_batches((2, 3, 8, 8), 2)
    qm = quantize_onnx(conv_relu_gemm(), batches, quiet=True)
    data = json.loads(qm.save_placement(tmp_path / "p.json").read_text())
    data["repairs"] = [{"repair": repair, "loss_before": 0.01, "loss_after": 0.001, "kept": True, "seconds": 0.1}]
    path = tmp_path / "named.json"
    path.write_text(json.dumps(data))
    return conv_relu_gemm, batches, path


@pytest.mark.parametrize("repair", ["quantum annealing", "Equalization"])
def test_a_placement_file_naming_an_unknown_repair_is_refused(tmp_path, repair):
    """A kept repair this netquant does not have (a hand edit, a newer netquant's repair, a wrong case) cannot be
    re-applied: refused with a ConfigError naming the file and the repair, never shipped without it."""
    from netquant.errors import ConfigError, NetquantError

    model, batches, path = _tiny_file_naming(tmp_path, repair)
    with pytest.raises(ConfigError, match=rf"placement file '{re.escape(str(path))}' was made with the repair "
                                          rf"'{repair}', which cannot be re-applied here; measure again") as info:
        quantize_onnx(model(), batches, quiet=True, placement_from=str(path))
    assert isinstance(info.value, NetquantError)


def test_a_placement_file_naming_a_repair_is_refused_with_one_shot_calibration_data(tmp_path):
    """A known repair needs the model calibrated again; calibration data given as a one-shot stream (a generator)
    cannot be read twice, so the file that names the repair is refused instead of shipping the unrepaired model; the
    same file with calibration batches in a list re-applies the repair."""
    from netquant.errors import ConfigError

    model, batches, path = _tiny_file_naming(tmp_path, "equalization")
    with pytest.raises(ConfigError, match=r"was made with the repair 'equalization', which cannot be re-applied "
                                          r"here; measure again \(drop placement_from\)") as info:
        quantize_onnx(model(), (b for b in batches), quiet=True, placement_from=str(path))
    assert str(path) in str(info.value)
    again = quantize_onnx(model(), batches, quiet=True, placement_from=str(path))
    assert again.placement.kept_repair() == "equalization"
    assert [r.decision for r in again.placement.regions] == ["int8", "int8"]
