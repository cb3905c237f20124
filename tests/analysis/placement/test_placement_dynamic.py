"""Placement's DYNAMIC decision: MatMul regions with the activation quantized at run time, by measurement, recorded
in and re-applied from the placement file."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import onnx
import pytest

from netquant.analysis.placement import DYNAMIC, FLOAT, INT8, Placement, Reason
from netquant.analysis.placement.dynamic import profile_decides
from netquant.api import quantize_onnx
from netquant.export.onnx_qdq import build_qdq_model
from tests.helpers.transformer_models import small_bert, small_bert_batches


@pytest.fixture(scope="module")
def bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return small_bert(tmp_path_factory.mktemp("bert") / "bert.onnx", seq=32)


def test_search_times_dynamic_and_the_export_follows_its_decisions(bert: Path, tmp_path: Path) -> None:
    qm = quantize_onnx(str(bert), small_bert_batches(4), objective="latency", quiet=True, placement_time_s=30)
    p = qm.placement
    assert {r.decision for r in p.regions} <= {INT8, DYNAMIC, FLOAT}
    matmuls = [r for r in p.regions if r.op_type == "MatMul" and r.decision != FLOAT]
    assert matmuls and all(r.dynamic_ms is not None and r.int8_ms is not None for r in matmuls)
    # the profile sums decide where they differ clearly (dynamic.profile_decides), else the files are timed
    by_profile = p.measured.get("dynamic_decided_by") == "profile sums"
    assert by_profile == profile_decides(p.measured["static_profile_ms"], p.measured["all_dynamic_profile_ms"])
    kind = "profile" if by_profile else "wall"
    for r in p.regions:
        if r.decision == DYNAMIC:  # where its profiled time beat the static one, or the all-dynamic file was fastest
            assert (r.reason == Reason.DYNAMIC and r.int8_ms > r.dynamic_ms) or (
                r.reason == Reason.ALL_DYNAMIC and p.measured[f"all_dynamic_{kind}_ms"] <= p.measured[f"static_{kind}_ms"])
    if p.dynamic_anchors():  # the shipped form was no slower than all static, and as accurate or within budget
        assert p.measured["loss_ort_static"] >= 0 and (by_profile or "static_wall_ms" in p.measured)
    assert p.measured["dynamic_candidates"] == len(matmuls)
    assert p.measured["dynamic_regions"] == len(p.dynamic_anchors())
    assert qm.qgraph.dynamic_ops == set(p.dynamic_anchors())
    model = build_qdq_model(qm.qgraph)[0]
    rewrite = qm.qgraph.attention_rewrite  # attention products kept dynamic by measurement (analysis.attention)
    products = {n for n, m in rewrite.modes if m.value == "dynamic"} if rewrite is not None else set()
    assert sorted(n.name for n in model.graph.node if n.op_type == "MatMulInteger" and n.name not in products) == \
        sorted(p.dynamic_anchors())
    saved = {r["anchor"]: r for r in json.loads(p.to_json())["regions"]}
    assert all(saved[r.anchor]["dynamic_ms"] == r.dynamic_ms for r in matmuls)


def test_placement_file_with_dynamic_regions_is_reapplied(bert: Path, tmp_path: Path) -> None:
    calib = small_bert_batches(4)
    qm = quantize_onnx(str(bert), calib, objective="balanced", quiet=True)
    data = json.loads(qm.placement.to_json())
    data["measured"].pop("attention", None)  # the regions' decisions alone (the attention rewrite: tests/analysis)
    chosen = [r["anchor"] for r in data["regions"] if r["op_type"] == "MatMul"][:3]
    for r in data["regions"]:
        r["decision"] = DYNAMIC if r["anchor"] in chosen else INT8
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    again = quantize_onnx(str(bert), calib, quiet=True, placement_from=str(path))
    assert again.placement.dynamic_anchors() == chosen and again.qgraph.dynamic_ops == set(chosen)
    out = tmp_path / "mixed.onnx"
    report = again.export(out)
    assert report.int8_kernels is not None and report.int8_kernels.get("DynamicQuantizeMatMul", 0) + \
        report.int8_kernels.get("MatMulIntegerToFloat", 0) == len([r for r in data["regions"]
                                                                  if r["op_type"] == "MatMul"])
    ops = Counter(n.op_type for n in onnx.load(str(out)).graph.node)
    assert ops["MatMulInteger"] == len(chosen) and ops["DynamicQuantizeLinear"] == len(chosen)
    assert Placement.load(path).dynamic_anchors() == chosen


def test_profile_sums_decide_only_where_they_differ_by_more_than_15_percent() -> None:
    from netquant.analysis.placement.constants import PROFILE_CLEAR

    assert PROFILE_CLEAR == 0.15
    assert not profile_decides(10.0, 11.5) and not profile_decides(11.5, 10.0)  # 15% of the smaller: timed
    assert profile_decides(10.0, 11.6) and profile_decides(11.6, 10.0)
    assert not profile_decides(6.957, 6.836)  # the built-in encoder's sums (static, all dynamic): timed


def test_profile_sums_that_decide_pick_the_smallest_sum_as_accurate_without_timing(
        bert: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from netquant.analysis.placement import dynamic

    monkeypatch.setattr(dynamic, "PROFILE_CLEAR", -1.0)  # every pair of sums "differs clearly": the sums decide
    qm = quantize_onnx(str(bert), small_bert_batches(4), objective="latency", quiet=True, placement_time_s=30)
    m = qm.placement.measured
    assert m["dynamic_decided_by"] == "profile sums" and "static_wall_ms" not in m and "all_dynamic_wall_ms" not in m
    options = [("static", 0, m["static_profile_ms"], m["loss_ort_static"]),
               ("all", m["dynamic_candidates"], m["all_dynamic_profile_ms"], m["loss_ort_all_dynamic"])]
    if "per_region_dynamic_profile_ms" in m:  # the per-region choice is neither all static nor all dynamic
        options.append(("per region", None, m["per_region_dynamic_profile_ms"], m["loss_ort_per_region_dynamic"]))
    limit = qm.placement.max_loss  # None for LATENCY
    fine = [o for o in options if o[3] <= m["loss_ort_static"] or (limit is not None and o[3] <= limit)]
    best = min(fine, key=lambda o: o[2])
    assert m["dynamic_regions"] == len(qm.qgraph.dynamic_ops)
    assert m["dynamic_regions"] == best[1] if best[1] is not None else 0 < m["dynamic_regions"] < m["dynamic_candidates"]


def test_the_dynamic_step_starts_only_within_the_time_cap(bert: Path) -> None:
    """Past placement's time cap the DYNAMIC step profiles nothing: every MatMul stays static, and the note and
    `measured` say so (the cap bounds latency measurements; raising placement_time_s measures them)."""
    qm = quantize_onnx(str(bert), small_bert_batches(4), objective="balanced", quiet=True, placement_time_s=0.0)
    p = qm.placement
    assert "dynamic regions not profiled (time cap): static kept" in p.note
    assert p.measured["dynamic_candidates"] > 0 and p.measured["dynamic_regions"] == 0
    assert "static_profile_ms" not in p.measured and not p.dynamic_anchors() and not qm.qgraph.dynamic_ops
    assert all(r.dynamic_ms is None for r in p.regions)
