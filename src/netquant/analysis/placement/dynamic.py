"""The DYNAMIC step (onnxruntime): INT8 MatMul regions with their activation quantized at run time where that
times faster and stays as accurate."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import onnx

from netquant.analysis.attention import place_attention
from netquant.analysis.placement.constants import (
    ATTENTION_SHARE,
    DYNAMIC_SHARE,
    PROFILE_CLEAR,
    PROFILE_RUNS,
    PROFILE_WARMUP,
    SLOWER_MARGIN,
    SLOWER_MS,
    WALL_BUDGET_S,
    WALL_ROUNDS,
    WALL_RUNS,
    WALL_THREADS,
)
from netquant.analysis.placement.measure import SearchState
from netquant.analysis.placement.records import DYNAMIC, FLOAT, INT8, Placement, Reason, significant
from netquant.analysis.profile import cpu_session, profile_onnx, region_times
from netquant.errors import ExportError

DYNAMIC_OPS = ("MatMul",)  # region anchors export.dynamic can rewrite


def _ort_runs(models: list[onnx.ModelProto], feeds: dict[str, np.ndarray], budget_s: float, timed_from: int = 0,
              sessions: list[Any] | None = None, timed: bool = True) -> tuple[list[np.ndarray], list[float]]:
    """Each model's first output on `feeds`, and (timed) the wall-clock ms of models[timed_from:] (interleaved rounds;
    onnxruntime CPU, one thread). sessions: per model, a session built already (analysis.profile.cpu_session, one
    thread) or None."""
    from netquant.analysis.timing import interleaved_ms

    given = sessions if sessions is not None else [None] * len(models)
    built = [g if g is not None else cpu_session(m, WALL_THREADS) for m, g in zip(models, given, strict=True)]
    t = time.perf_counter()
    outputs = [np.asarray(sess.run(None, feeds)[0], dtype=np.float64).ravel() for sess in built]
    if not timed:
        return outputs, []
    one = max(time.perf_counter() - t, 1e-6)
    rounds = max(3, min(WALL_ROUNDS, int(budget_s / one)))
    ms = interleaved_ms([lambda sess=sess: sess.run(None, feeds) for sess in built[timed_from:]],
                        per_round=WALL_RUNS, rounds=rounds, warmup=0)
    return outputs, ms


def profile_decides(static_ms: float, dynamic_ms: float) -> bool:
    """Whether the profile sums of the all-static and all-dynamic files differ clearly: by more than PROFILE_CLEAR of
    the smaller one (then they decide the latency choice, no wall clock)."""
    return abs(static_ms - dynamic_ms) > PROFILE_CLEAR * min(static_ms, dynamic_ms)


def _one_minus_cos(a: np.ndarray, b: np.ndarray) -> float:
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return 0.0 if den == 0 else max(0.0, 1.0 - float(a @ b) / den)


def choose_dynamic(s: SearchState, placement: Placement, source: onnx.ModelProto | None, max_loss: float | None,
                    cap_s: float) -> Placement:
    """The DYNAMIC step, after the INT8 / float decision (onnxruntime), started only within placement's time cap
    (s.deadline; past it every region stays static, and the note says so): the INT8 MatMul regions are profiled with
    their activation quantized at run time (export.dynamic) and with static Q/DQ; the per-region choice puts a region
    DYNAMIC where its static time exceeds SLOWER_MARGIN x its dynamic time + SLOWER_MS. Then up to three files are
    compared: all static, every candidate dynamic, and the per-region choice (only where it is neither). Where the
    profile sums of the first two differ by more than PROFILE_CLEAR (profile_decides) the sums decide (the per-region
    file's: the static sum less its regions' static - dynamic times); else the files run against each other (wall
    clock, interleaved: the per-node profile misses onnxruntime's fusions across regions, e.g. a bias Add fused into
    DynamicQuantizeMatMul), started only within DYNAMIC_SHARE x cap_s of the step's start and within what is left
    of it. Either way the fastest whose output is no farther from the source's (1 - cosine, onnxruntime, the placement's
    batch) than the static file's, or within max_loss, ships. Every candidate region's dynamic time is recorded
    (dynamic_ms); qgraph.dynamic_ops holds the result."""
    from netquant.export.onnx_qdq import build_qdq_model, fp32_onnx

    qgraph = s.qgraph
    deadline = time.perf_counter() + DYNAMIC_SHARE * cap_s
    decisions = {r.anchor: r for r in placement.regions}
    candidates = sorted(a for a, r in decisions.items()
                        if r.decision == INT8 and s.by_anchor[a].op_type in DYNAMIC_OPS)
    if not candidates or s.feeds is None:
        return placement
    t0 = time.perf_counter()
    if t0 >= s.deadline:  # a latency refinement: it starts only within placement's time cap
        placement.note = "; ".join(filter(None, [placement.note, "dynamic regions not profiled (time cap): static kept"]))
        placement.measured.update({"dynamic_candidates": len(candidates), "dynamic_regions": 0, "dynamic_s": 0.0})
        return placement

    def build(dynamic: list[str]) -> onnx.ModelProto:
        qgraph.dynamic_ops = set(dynamic)
        try:
            return build_qdq_model(qgraph, share=True)[0]  # (not modified: the export may take it)
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
        # the profiled sessions are kept: where the profile sums decide, the files' outputs come from them (no
        # second session of each; profiling changes no kernel, so the outputs are a plain session's)
        p_static = profile_onnx(static, s.feeds, runs=PROFILE_RUNS, warmup=PROFILE_WARMUP, keep_session=True)
        p_dynamic = profile_onnx(everything, s.feeds, runs=PROFILE_RUNS, warmup=PROFILE_WARMUP, keep_session=True)
        t_static = region_times(p_static, s.nmap, s.region_of, int8)
        t_dynamic = region_times(p_dynamic, s.nmap, s.region_of, int8)
        for a in candidates:
            # both times from this step's two profiles (same feeds, same builds): the pair the choice below reads
            decisions[a].dynamic_ms = round(t_dynamic.get(a, 0.0), 4)
            decisions[a].int8_ms = round(t_static.get(a, 0.0), 4)
            if t_static.get(a, 0.0) > SLOWER_MARGIN * t_dynamic.get(a, 0.0) + SLOWER_MS:
                chosen.append(a)
        measured.update({"dynamic_candidates": len(candidates), "static_profile_ms": p_static.node_total_ms,
                         "all_dynamic_profile_ms": p_dynamic.node_total_ms})
    note, reason = "", Reason.DYNAMIC
    # the profile sums decide where they differ clearly; else the files are timed, within the step's share of the cap
    by_profile = bool(candidates) and profile_decides(p_static.node_total_ms, p_dynamic.node_total_ms)
    if candidates and (by_profile or time.perf_counter() < deadline):
        # the files to compare: static, every candidate dynamic, and the per-region choice where it is neither
        options: list[list[str]] = [[], candidates] + ([chosen] if chosen and chosen != candidates else [])
        models = [static, everything] + ([build(chosen)] if len(options) == 3 else [])
        reference = source if source is not None else fp32_onnx(qgraph)
        try:
            ref_session = s.session_of(source) if source is not None else None
            # timed: fresh sessions for every file (as warm as each other); outputs only: the profiled ones
            given = [p_static.session, p_dynamic.session] if by_profile else [None, None]
            outs, times = _ort_runs([reference, *models], s.feeds, min(WALL_BUDGET_S, max(0.0, deadline - time.perf_counter())),
                                    timed_from=1, sessions=[ref_session, *given] + [None] * (len(models) - 2),
                                    timed=not by_profile)
        except Exception as exc:  # the source does not run in onnxruntime: no confirmation, stay static
            note, chosen = f"dynamic regions not confirmed ({str(exc).splitlines()[0][:120]}): static kept", []
        else:
            losses = [_one_minus_cos(o, outs[0]) for o in outs[1:]]
            if by_profile:  # the per-region file's sum: the static one with the chosen regions' dynamic times
                times = [p_static.node_total_ms, p_dynamic.node_total_ms,
                         p_static.node_total_ms - sum(t_static.get(a, 0.0) - t_dynamic.get(a, 0.0) for a in chosen)]
                times = times[:len(options)]
                measured["dynamic_decided_by"] = "profile sums"
            else:
                measured.update({"static_wall_ms": times[0], "all_dynamic_wall_ms": times[1]})
            measured.update({"loss_ort_static": significant(losses[0]),
                             "loss_ort_all_dynamic": significant(losses[1])})
            if len(options) == 3:
                measured.update({"per_region_dynamic_profile_ms" if by_profile else "per_region_dynamic_wall_ms":
                                 times[2], "loss_ort_per_region_dynamic": significant(losses[2])})
            # accurate enough: no farther from the source than the static file, or within max_loss
            fine = [i for i in range(len(options))
                    if losses[i] <= losses[0] or (max_loss is not None and losses[i] <= max_loss)]
            best = min(fine, key=lambda i: (times[i], i))
            if best == 1 and chosen != candidates:
                reason = Reason.ALL_DYNAMIC
            chosen = options[best]
            if best == 0:
                note = "static " + ("profiled" if by_profile else "timed") + " fastest: every region static"
    else:
        note, chosen = ("dynamic regions not confirmed (time cap): static kept" if candidates else ""), []
    for a in chosen:
        decisions[a].decision, decisions[a].reason = DYNAMIC, reason
    if candidates:  # the profiled sessions are not needed any more
        p_static.session = p_dynamic.session = None
    qgraph.dynamic_ops = set(chosen)
    measured.update({"dynamic_regions": len(chosen), "dynamic_s": round(time.perf_counter() - t0, 4)})
    placement.note = "; ".join(filter(None, [placement.note, note]))
    return placement


def choose_dynamic_and_attention(s: SearchState, placement: Placement, source: onnx.ModelProto | None,
                                 max_loss: float | None, cap_s: float) -> Placement:
    """choose_dynamic, then the transformer ops by measurement (analysis.attention; recorded as
    measured['attention']), their tries ending within ATTENTION_SHARE x cap_s (not measured at all where its setup
    alone would take longer: analysis.attention.setup_estimate_s, its session build estimated by the source's); both
    reuse the search's session of the source (SearchState.session_of)."""
    placement = choose_dynamic(s, placement, source, max_loss, cap_s)
    session = None
    if source is not None:
        try:
            session = s.session_of(source)
        except ExportError:  # the source does not load in onnxruntime: place_attention's own session says so
            session = None
    m = placement.measured
    fp32_ms = m.get("source_fp32_wall_ms", m.get("fp32_ms"))  # batch 1: the setup's estimate (place_attention)
    attention = place_attention(s.qgraph, s.feeds, source, cap_s, deadline=time.perf_counter() + ATTENTION_SHARE * cap_s,
                                source_session=session, fp32_ms=float(fp32_ms) if fp32_ms is not None else None,
                                build_s=s.source_build_s, sessions=s.timed_sessions)
    if attention is not None:
        placement.measured["attention"] = attention.as_dict()
    return placement
