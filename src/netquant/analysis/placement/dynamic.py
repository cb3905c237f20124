"""The DYNAMIC step (onnxruntime): INT8 MatMul regions with their activation quantized at run time where that
times faster and stays as accurate."""

from __future__ import annotations

import time

import numpy as np
import onnx

from netquant.analysis.attention import place_attention
from netquant.analysis.placement.constants import (
    PROFILE_RUNS,
    PROFILE_WARMUP,
    SLOWER_MARGIN,
    SLOWER_MS,
    WALL_BUDGET_S,
    WALL_ROUNDS,
    WALL_RUNS,
)
from netquant.analysis.placement.measure import SearchState
from netquant.analysis.placement.records import DYNAMIC, FLOAT, INT8, Placement, Reason
from netquant.analysis.profile import profile_onnx, region_times

DYNAMIC_OPS = ("MatMul",)  # region anchors export.dynamic can rewrite


def _ort_runs(models: list[onnx.ModelProto], feeds: dict[str, np.ndarray], budget_s: float, timed_from: int = 0
              ) -> tuple[list[np.ndarray], list[float]]:
    """Each model's first output on `feeds`, and the wall-clock ms of models[timed_from:] (interleaved rounds;
    onnxruntime CPU, one thread)."""
    import onnxruntime as ort

    from netquant.analysis.timing import interleaved_ms

    so = ort.SessionOptions()
    so.intra_op_num_threads = so.inter_op_num_threads = 1
    so.log_severity_level = 3
    sessions = [ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"]) for m in models]
    t = time.perf_counter()
    outputs = [np.asarray(sess.run(None, feeds)[0], dtype=np.float64).ravel() for sess in sessions]
    one = max(time.perf_counter() - t, 1e-6)
    rounds = max(3, min(WALL_ROUNDS, int(budget_s / one)))
    ms = interleaved_ms([lambda sess=sess: sess.run(None, feeds) for sess in sessions[timed_from:]],
                        per_round=WALL_RUNS, rounds=rounds, warmup=0)
    return outputs, ms


def _one_minus_cos(a: np.ndarray, b: np.ndarray) -> float:
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return 0.0 if den == 0 else max(0.0, 1.0 - float(a @ b) / den)


def choose_dynamic(s: SearchState, placement: Placement, source: onnx.ModelProto | None, max_loss: float | None,
                    cap_s: float) -> Placement:
    """The DYNAMIC step, after the INT8 / float decision (onnxruntime): the INT8 MatMul regions are profiled with
    their activation quantized at run time (export.dynamic) and with static Q/DQ; the per-region choice puts a region
    DYNAMIC where its static time exceeds SLOWER_MARGIN x its dynamic time + SLOWER_MS. Then three files run
    against each other (wall clock, interleaved: the per-node profile misses onnxruntime's fusions across regions,
    e.g. a bias Add fused into DynamicQuantizeMatMul): all static, every candidate dynamic, and the per-region
    choice; the fastest whose output is no farther from the source's (1 - cosine, onnxruntime, the placement's
    batch) than the static file's, or within max_loss, ships. Every candidate region's dynamic time is recorded
    (dynamic_ms); qgraph.dynamic_ops holds the result."""
    from netquant.export.onnx_qdq import build_qdq_model, fp32_onnx

    qgraph = s.qgraph
    deadline = time.perf_counter() + cap_s
    decisions = {r.anchor: r for r in placement.regions}
    candidates = sorted(a for a, r in decisions.items()
                        if r.decision == INT8 and s.by_anchor[a].op_type in DYNAMIC_OPS)
    if not candidates or s.feeds is None:
        return placement
    t0 = time.perf_counter()

    def build(dynamic: list[str]) -> onnx.ModelProto:
        qgraph.dynamic_ops = set(dynamic)
        try:
            return build_qdq_model(qgraph)[0]
        finally:
            qgraph.dynamic_ops = set()

    # the static file: the one the search built and timed already where no region is float
    static = s.built.get(frozenset()) if not placement.float_anchors() else None
    static = static if static is not None else build([])
    everything = build(candidates)
    rewritten = {n.name for n in everything.graph.node if n.op_type == "MatMulInteger"}
    candidates = [a for a in candidates if a in rewritten]
    int8 = {a for a, r in decisions.items() if r.decision != FLOAT}
    measured = placement.measured
    chosen: list[str] = []
    if candidates:
        p_static = profile_onnx(static, s.feeds, runs=PROFILE_RUNS, warmup=PROFILE_WARMUP)
        p_dynamic = profile_onnx(everything, s.feeds, runs=PROFILE_RUNS, warmup=PROFILE_WARMUP)
        t_static = region_times(p_static, s.nmap, s.region_of, int8)
        t_dynamic = region_times(p_dynamic, s.nmap, s.region_of, int8)
        for a in candidates:
            decisions[a].dynamic_ms = round(t_dynamic.get(a, 0.0), 4)
            if decisions[a].int8_ms is None:
                decisions[a].int8_ms = round(t_static.get(a, 0.0), 4)
            if t_static.get(a, 0.0) > SLOWER_MARGIN * t_dynamic.get(a, 0.0) + SLOWER_MS:
                chosen.append(a)
        measured.update({"dynamic_candidates": len(candidates), "static_profile_ms": p_static.node_total_ms,
                         "all_dynamic_profile_ms": p_dynamic.node_total_ms})
    note, reason = "", Reason.DYNAMIC
    if candidates and time.perf_counter() < deadline:
        # the files to time: static, every candidate dynamic, and the per-region choice where it is neither
        options: list[list[str]] = [[], candidates] + ([chosen] if chosen and chosen != candidates else [])
        models = [static, everything] + ([build(chosen)] if len(options) == 3 else [])
        reference = source if source is not None else fp32_onnx(qgraph)
        try:
            outs, times = _ort_runs([reference, *models], s.feeds, WALL_BUDGET_S, timed_from=1)
        except Exception as exc:  # the source does not run in onnxruntime: no confirmation, stay static
            note, chosen = f"dynamic regions not confirmed ({str(exc).splitlines()[0][:120]}): static kept", []
        else:
            losses = [_one_minus_cos(o, outs[0]) for o in outs[1:]]
            measured.update({"static_wall_ms": times[0], "all_dynamic_wall_ms": times[1],
                             "loss_ort_static": float(f"{losses[0]:.6g}"),
                             "loss_ort_all_dynamic": float(f"{losses[1]:.6g}")})
            if len(options) == 3:
                measured.update({"per_region_dynamic_wall_ms": times[2],
                                 "loss_ort_per_region_dynamic": float(f"{losses[2]:.6g}")})
            # accurate enough: no farther from the source than the static file, or within max_loss
            fine = [i for i in range(len(options))
                    if losses[i] <= losses[0] or (max_loss is not None and losses[i] <= max_loss)]
            best = min(fine, key=lambda i: (times[i], i))
            if best == 1 and chosen != candidates:
                reason = Reason.ALL_DYNAMIC
            chosen = options[best]
            if best == 0:
                note = "static timed fastest: every region static"
    else:
        note, chosen = ("dynamic regions not confirmed (time cap): static kept" if candidates else ""), []
    for a in chosen:
        decisions[a].decision, decisions[a].reason = DYNAMIC, reason
    qgraph.dynamic_ops = set(chosen)
    measured.update({"dynamic_regions": len(chosen), "dynamic_s": round(time.perf_counter() - t0, 4)})
    placement.note = "; ".join(filter(None, [placement.note, note]))
    return placement


def choose_dynamic_and_attention(s: SearchState, placement: Placement, source: onnx.ModelProto | None,
                                 max_loss: float | None, cap_s: float) -> Placement:
    """choose_dynamic, then the transformer ops by measurement (analysis.attention; recorded as
    measured['attention'])."""
    placement = choose_dynamic(s, placement, source, max_loss, cap_s)
    attention = place_attention(s.qgraph, s.feeds, source, cap_s)
    if attention is not None:
        placement.measured["attention"] = attention.as_dict()
    return placement
