"""analysis.placement: measured INT8-or-float per region, the accuracy budget, placement files, CLI flags."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from netquant.analysis.placement import Placement, Reason
from netquant.api import quantize_onnx
from netquant.errors import ConfigError
from netquant.export import build_qdq_model
from netquant.passes.settings import Objective
from tests.helpers.onnx_models import calib_batches, conv_relu_gemm
from tests.helpers.placement_models import conv_stack, stack_batches

X = {"x": torch.from_numpy(stack_batches(1, seed=7)[0])}


def _q(**kw):
    kw.setdefault("placement_time_s", 30.0)
    return quantize_onnx(conv_stack(), stack_batches(), quiet=True, **kw)


def test_latency_decisions_follow_the_measurements():
    qm = _q(objective="latency")
    p = qm.placement
    assert p is not None and p.objective == "latency" and p.max_loss is None
    assert [r.anchor for r in p.regions] == ["conv0", "conv1", "conv2"]
    for r in p.regions:
        assert r.int8_ms is not None and r.int8_ms > 0 and r.fp32_ms is not None and r.fp32_ms > 0
        if r.reason == Reason.SLOWER:
            assert r.decision == "float" and r.int8_ms > 1.05 * r.fp32_ms + 0.002
        if r.reason == Reason.FASTER:
            assert r.decision == "int8" and r.int8_ms <= 1.05 * r.fp32_ms + 0.002
    m = p.measured
    assert m["fp32_ms"] > 0 and m["all_int8_ms"] > 0 and m["placed_ms"] > 0 and m["profiles"] >= 2
    s = qm.summary()["placement"]
    assert s["int8_regions"] + s["float_regions"] == 3 and len(s["regions"]) == 3
    assert "placement" in qm.timings


def test_balanced_keeps_int8_unless_the_model_would_be_slower_than_fp32():
    """BALANCED is INT8 first: a region measured slower in INT8 stays INT8 (Reason.KEPT) when the model is no
    slower than FP32, and only the slower regions needed to get there are floated (no budget: max_loss=1e9)."""
    qm = _q(objective="balanced", max_loss=1e9)
    p = qm.placement
    assert p is not None and p.objective == "balanced"
    m = p.measured
    for r in p.regions:
        assert r.reason in (Reason.FASTER, Reason.KEPT, Reason.SLOWER, Reason.FORCED)
        if r.reason == Reason.KEPT:
            assert r.decision == "int8" and r.int8_ms > 1.05 * r.fp32_ms + 0.002
    floated = [r for r in p.regions if r.decision == "float"]
    assert m["source_fp32_wall_ms"] > 0 and m["all_int8_wall_ms"] > 0  # timed against the user's FP32 model
    if m["all_int8_wall_ms"] <= m["source_fp32_wall_ms"]:  # the all-INT8 file beats FP32: nothing floats for speed
        assert not floated and m["placed_ms"] == m["all_int8_ms"]
        assert m["speedup_vs_fp32"] == pytest.approx(m["source_fp32_wall_ms"] / m["all_int8_wall_ms"], rel=1e-4)
    else:
        assert all(r.reason == Reason.SLOWER for r in floated)


def test_a_source_onnxruntime_cannot_run_falls_back_to_the_cleaned_graph():
    """INT8 first times the user's FP32 model; one onnxruntime cannot load is named in the note, not raised."""
    import onnx

    from netquant.analysis.placement import search_placement
    from netquant.passes.settings import QuantSettings

    qm = quantize_onnx(conv_stack(), stack_batches(), quiet=True, objective=None)
    settings = QuantSettings.from_kwargs("onnxruntime_int8", {"objective": "balanced", "max_loss": 1e9})
    p = search_placement(qm.qgraph, settings, time_budget_s=30.0, source=onnx.ModelProto())
    assert p.note.startswith("source model not timed (onnxruntime cannot load the model to time it")
    assert "source_fp32_wall_ms" not in p.measured and p.measured["fp32_ms"] > 0


def test_zero_budget_keeps_everything_float_and_matches_fp32():
    """max_loss=0: any quantization error breaks the budget, so every region ends in float and the fake-quant
    model computes the FP32 graph exactly."""
    qm = _q(objective="accuracy", max_loss=0.0)
    assert all(r.decision == "float" for r in qm.placement.regions)
    assert {r.reason for r in qm.placement.regions} <= {Reason.BUDGET, Reason.SLOWER}
    assert torch.equal(qm.run(X)["c2"], qm.run(X, fake_quant=False)["c2"])
    assert qm.placement.measured["loss_placed"] == 0.0
    assert qm.placement.measured["loss_all_int8"] > 0.0


def test_user_metric_loss_equals_its_definition():
    """metric + eval_data: loss = metric(FP32) - metric(INT8); with target = the FP32 output and metric = -MSE, the
    all-INT8 loss is the MSE of the rules-only model against FP32."""
    ref = quantize_onnx(conv_stack(), stack_batches(), quiet=True, objective=None)
    target = ref.run(X, fake_quant=False)["c2"]
    mse = float(((ref.run(X)["c2"] - target) ** 2).mean())

    def metric(outputs, t):
        return -float(((outputs["c2"] - t) ** 2).mean())

    qm = _q(objective="balanced", max_loss=1e9, metric=metric, eval_data=[(X, target)])
    assert qm.placement.loss_metric == "user metric drop"
    assert qm.placement.measured["loss_all_int8"] == pytest.approx(mse, rel=1e-5)
    assert all(r.reason != Reason.BUDGET for r in qm.placement.regions)


def test_placement_file_round_trip_reproduces_the_model(tmp_path):
    qm = _q(objective="accuracy", max_loss=0.0)
    path = qm.save_placement(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["format"] == "netquant.placement/1" and data["platform"] == "onnxruntime_int8"
    assert {"cpu", "kernel_family", "onnxruntime"} <= set(data["host"])
    assert len(data["model_sha256"]) == 64 and len(data["regions"]) == 3
    again = quantize_onnx(conv_stack(), stack_batches(), quiet=True, placement_from=str(path))
    assert again.placement.float_anchors() == qm.placement.float_anchors()
    assert "re-applied" in again.placement.note
    a = build_qdq_model(qm.qgraph)[0].SerializeToString(deterministic=True)
    b = build_qdq_model(again.qgraph)[0].SerializeToString(deterministic=True)
    assert a == b
    assert Placement.load(path).to_json() == path.read_text()


def test_placement_file_for_another_model_is_refused(tmp_path):
    path = _q(objective="latency").save_placement(tmp_path / "p.json")
    with pytest.raises(ConfigError, match="another model"):
        quantize_onnx(conv_stack(seed=5), stack_batches(), quiet=True, placement_from=str(path))
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a netquant placement file"):
        quantize_onnx(conv_stack(), stack_batches(), quiet=True, placement_from=str(tmp_path / "bad.json"))


def test_small_models_keep_the_rules_and_bad_settings_fail():
    qm = quantize_onnx(conv_relu_gemm(), calib_batches((2, 3, 8, 8), 2), quiet=True)
    assert qm.placement is not None and "not measured" in qm.placement.note
    assert all(r.decision == "int8" for r in qm.placement.regions)
    assert quantize_onnx(conv_relu_gemm(), calib_batches((2, 3, 8, 8), 2), quiet=True, objective=None).placement is None
    assert Objective.parse("latency") is Objective.LATENCY
    with pytest.raises(ConfigError, match="objective must be one of"):
        quantize_onnx(conv_relu_gemm(), calib_batches((2, 3, 8, 8), 2), quiet=True, objective="fast")
    with pytest.raises(ConfigError, match="metric and eval_data go together"):
        quantize_onnx(conv_relu_gemm(), calib_batches((2, 3, 8, 8), 2), quiet=True, metric=lambda o, t: 0.0)
    with pytest.raises(ConfigError, match="max_loss"):
        quantize_onnx(conv_relu_gemm(), calib_batches((2, 3, 8, 8), 2), quiet=True, max_loss=-1)


def test_cli_objective_placement_and_report(tmp_path):
    import onnx
    from click.testing import CliRunner

    from netquant.cli.main import cli

    model = tmp_path / "m.onnx"
    onnx.save(conv_stack(), str(model))
    np.save(tmp_path / "calib.npy", np.concatenate(stack_batches()))
    out, place, report = tmp_path / "q.onnx", tmp_path / "p.json", tmp_path / "r.md"
    res = CliRunner().invoke(cli, ["quantize", str(model), "--calib", str(tmp_path / "calib.npy"), "-o", str(out),
                                   "--objective", "accuracy", "--max-loss", "0", "--placement", str(place),
                                   "--report", str(report), "--allow-float"])  # max-loss 0: every region float
    assert res.exit_code == 0, res.output
    assert json.loads(place.read_text())["objective"] == "accuracy"
    text = report.read_text()
    assert "## Placement" in text and "conv1" in text and "accuracy budget" in text
    out2 = tmp_path / "q2.onnx"
    res = CliRunner().invoke(cli, ["quantize", str(model), "--calib", str(tmp_path / "calib.npy"), "-o", str(out2),
                                   "--placement-from", str(place), "--quiet", "--allow-float"])
    assert res.exit_code == 0, res.output
    assert onnx.load(str(out2)).graph == onnx.load(str(out)).graph


def test_untimed_platform_gets_the_accuracy_budget_alone(tmp_path):
    """A platform whose engine is not timed here (academic_int8: Q/DQ reference) is not profiled; the budget floats
    regions (most loss saved first) until the fake-quant loss, recomputed here, is within max_loss, and the
    exported file runs what the placement decided."""
    from netquant.analysis.regions import find_regions
    from netquant.analysis.sensitivity import LossMeter
    from netquant.export import export_qdq

    free = quantize_onnx(conv_stack(), stack_batches(), "academic_int8", quiet=True, max_loss=1.0,
                         placement_time_s=30.0)
    assert all(r.decision == "int8" and r.reason == Reason.NOT_TIMED for r in free.placement.regions)
    assert "fp32_ms" not in free.placement.measured and "speed not measured" in free.placement.note
    all_int8 = free.placement.measured["loss_all_int8"]
    assert all_int8 > 0
    budget = all_int8 / 4
    qm = quantize_onnx(conv_stack(), stack_batches(), "academic_int8", quiet=True, max_loss=budget,
                       placement_time_s=30.0)
    floated = [r for r in qm.placement.regions if r.decision == "float"]
    assert floated and all(r.reason == Reason.BUDGET for r in floated)
    assert {r.reason for r in qm.placement.regions if r.decision == "int8"} <= {Reason.NOT_TIMED}
    meter = LossMeter(qm.qgraph, [{k: v[:4] for k, v in qm.qgraph.validation_batches[0].items()}])
    assert meter.loss([]) == pytest.approx(qm.placement.measured["loss_placed"], rel=1e-9)  # recomputed
    assert qm.placement.measured["loss_placed"] <= budget
    still = {r.anchor for r in find_regions(qm.qgraph)}  # the quantized regions left: exactly the INT8 decisions
    assert still == {r.anchor for r in qm.placement.regions if r.decision == "int8"}
    report = export_qdq(qm.qgraph, tmp_path / "m.onnx")
    assert report.validated and report.reference_only
    assert report.quantized_ops and not any(op in report.quantized_ops for r in floated for op in r.ops)


def test_wider_format_before_float_and_its_placement_file(tmp_path):
    """academic_int4 names int8 (W8A8) as its wider format: the budget runs the regions in it, the most helped first,
    until the fake-quant loss (recomputed here) is within WIDER_SHARE x max_loss, floats none while that is enough,
    and floats on top only when it is not (max_loss 0); the placement file re-applies the wide regions to the same
    file, and the exported file runs what the placement decided."""
    from netquant.analysis.placement import WIDER_SHARE
    from netquant.analysis.sensitivity import LossMeter
    from netquant.export import export_qdq

    def q(**kw):
        return quantize_onnx(conv_stack(), stack_batches(), "academic_int4", quiet=True, placement_time_s=30.0, **kw)

    free = q(max_loss=1.0)
    assert {r.decision for r in free.placement.regions} == {"int8"}
    all_int8 = free.placement.measured["loss_all_int8"]
    qm = q(max_loss=all_int8)
    p = qm.placement
    wide = [r for r in p.regions if r.decision == "wider"]
    assert wide and not p.float_anchors() and p.wider_anchors() == [r.anchor for r in wide]
    assert all(r.reason == Reason.WIDER and r.wider_format == "int8 (W8A8)" for r in wide)
    assert all(r.wider_gain is not None and r.wider_gain > 0 for r in wide)
    assert p.measured["loss_placed"] <= WIDER_SHARE * all_int8 < p.measured["loss_all_int8"]
    meter = LossMeter(qm.qgraph, [{k: v[:4] for k, v in qm.qgraph.validation_batches[0].items()}])
    assert meter.loss([]) == pytest.approx(p.measured["loss_placed"], rel=1e-9)  # the graph runs the decision
    summary = qm.summary()["placement"]
    assert summary["wider_regions"] == len(wide) and summary["float_regions"] == 0
    assert "wider: int8 (W8A8)" in p.markdown()
    from netquant.cli.quantize_cmd import _placement_line

    n8 = sum(r.decision == "int8" for r in p.regions)
    assert f"{n8} of {len(p.regions)} regions in int4 (W4A4), {len(wide)} in the wider format (int8 (W8A8))" in \
        _placement_line(qm)
    report = export_qdq(qm.qgraph, tmp_path / "m.onnx")
    assert report.validated and report.reference_only

    twice = build_qdq_model(q(max_loss=all_int8).qgraph)[0].SerializeToString(deterministic=True)
    assert twice == build_qdq_model(qm.qgraph)[0].SerializeToString(deterministic=True)  # deterministic

    path = qm.save_placement(tmp_path / "p.json")
    assert Placement.load(path).to_json() == path.read_text()
    again = quantize_onnx(conv_stack(), stack_batches(), "academic_int4", quiet=True, placement_from=str(path))
    assert again.placement.wider_anchors() == p.wider_anchors() and not again.placement.float_anchors()
    a = build_qdq_model(qm.qgraph)[0].SerializeToString(deterministic=True)
    b = build_qdq_model(again.qgraph)[0].SerializeToString(deterministic=True)
    assert a == b
    from netquant.analysis.placement import apply_placement_file

    rules_only = quantize_onnx(conv_stack(), stack_batches(), "academic_int4", quiet=True, objective=None)
    with pytest.raises(ConfigError, match=r"placement file '.*p\.json' runs regions in the wider format, but .* "
                                          "a list, not a one-shot stream"):
        apply_placement_file(rules_only.qgraph, path)  # no wide-format twin to take them from

    strict = q(max_loss=0.0)  # no wide placement reaches 0: every region float, after the wider format was tried
    assert strict.placement.float_anchors() == [r.anchor for r in strict.placement.regions]
    assert all(r.reason == Reason.WIDER_NOT_ENOUGH for r in strict.placement.regions)
    assert strict.placement.measured["loss_placed"] == 0.0


def test_platforms_without_a_wider_format_place_as_before():
    """A platform without Platform.wider never calibrates a wide twin: decisions are int8 or float only."""
    qm = quantize_onnx(conv_stack(), stack_batches(), "academic_int8", quiet=True, max_loss=0.0, placement_time_s=30.0)
    assert {r.decision for r in qm.placement.regions} == {"float"}
    assert all(r.wider_format is None and r.wider_gain is None for r in qm.placement.regions)
    assert qm.placement.summary()["wider_regions"] == 0


def test_wider_format_from_a_graph_input():
    """A netquant Graph input (edited in place by quantization) gets its wide twin from a copy taken before: the same
    decisions as from the ONNX model."""
    from netquant.graph import load_onnx

    ref = quantize_onnx(conv_stack(), stack_batches(), "academic_int4", quiet=True, max_loss=0.02,
                        placement_time_s=30.0)
    from_graph = quantize_onnx(load_onnx(conv_stack()), stack_batches(), "academic_int4", quiet=True, max_loss=0.02,
                               placement_time_s=30.0)
    assert from_graph.placement.wider_anchors() == ref.placement.wider_anchors() != []
