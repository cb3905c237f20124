"""The latency measurements of one placement search: exports of candidates, per-node profiles, wall-clock timings
and each region's INT8 / FP32 time (SearchState)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx

from netquant.analysis.placement.constants import (
    PROFILE_RUNS,
    PROFILE_WARMUP,
    SLOWER_MARGIN,
    SLOWER_MS,
    WALL_BUDGET_S,
    WALL_CLEAR,
    WALL_ROUNDS,
    WALL_RUNS,
    WALL_THREADS,
)
from netquant.analysis.placement.inputs import batch1
from netquant.analysis.placement.records import WEIGHT_ONLY
from netquant.analysis.profile import (
    NodeMap,
    OrtProfile,
    cpu_session,
    ort_requantizes,
    profile_onnx,
    region_times,
    wall_clock_ms,
)
from netquant.analysis.regions import find_regions, keep_float
from netquant.export.ort_kernels import INT8_KERNEL_OPS
from netquant.passes.quant_graph import EngineRun, FP32Session, QuantizedGraph
from netquant.passes.settings import QuantSettings


def clear_verdict(ms: list[float]) -> bool:
    """The whole-model check's medians [FP32, INT8] so far leave no doubt (WALL_CLEAR either way)."""
    fp32, int8 = ms
    return int8 <= (1 - WALL_CLEAR) * fp32 or int8 >= (1 + WALL_CLEAR) * fp32


class SearchState:
    """State of one placement search (see the module docstring)."""

    def __init__(self, qgraph: QuantizedGraph, settings: QuantSettings, deadline: float) -> None:
        self.qgraph = qgraph
        self.settings = settings
        self.deadline = deadline
        self.regions = find_regions(qgraph)
        self.by_anchor = {r.anchor: r for r in self.regions}
        self.region_of = {op: r.anchor for r in self.regions for op in r.ops}
        self.nmap = NodeMap(qgraph.graph)
        batch = qgraph.sample_inputs if qgraph.sample_inputs is not None else (
            qgraph.validation_batches[0] if qgraph.validation_batches else None)
        self.feeds: dict[str, np.ndarray] | None = batch1(batch, qgraph) if batch is not None else None
        self.t8: dict[str, float] = {}
        self.t32: dict[str, float] = {}
        self.forced: set[str] = set()
        self.profiles = 0
        self.profile_s = 0.0
        self.built: dict[frozenset[str], onnx.ModelProto] = {}
        self.weight_only: frozenset[str] = frozenset()  # edge regions weight-only (search.apply_weight_only)
        self.source: onnx.ModelProto | None = None
        self.source_session: Any = None
        self.source_build_s = 0.0  # seconds session_of took to serialize the source and build its session
        # the sessions (WALL_THREADS threads) of the other models the latest wall_clock timed: the attention step
        # times and scores the placed file in its own
        self.timed_sessions: list[tuple[onnx.ModelProto, Any]] = []

    def session_of(self, source: onnx.ModelProto) -> Any:
        """The onnxruntime session (WALL_THREADS threads) of the user's FP32 model, built once per search and kept on
        the quantized graph (QuantizedGraph.fp32_session) for export.fidelity's FP32 reference; ExportError when it
        does not load."""
        if self.source is not source or self.source_session is None:
            t = time.perf_counter()
            self.source_session, self.source = cpu_session(source, WALL_THREADS), source
            self.source_build_s = time.perf_counter() - t
            self.qgraph.fp32_session = FP32Session(source, WALL_THREADS, self.source_session)
        return self.source_session

    def build(self, float_set: set[str]) -> onnx.ModelProto:
        """The QDQ export of the quantized graph with `float_set` kept in float (memoised)."""
        from netquant.export.onnx_qdq import build_qdq_model

        key = frozenset(float_set)
        if key not in self.built:
            with keep_float(self.qgraph, [self.by_anchor[a] for a in sorted(float_set)]):
                self.built[key] = build_qdq_model(self.qgraph, share=True)[0]
        return self.built[key]

    def wall_clock(self, models: list[onnx.ModelProto], settled: Callable[[list[float]], bool] | None = None,
                   source: onnx.ModelProto | None = None) -> list[float]:
        """Wall-clock ms of each model against the others (analysis.profile.wall_clock_ms within WALL_BUDGET_S, at
        most what the time cap has left: fewer runs per round, then fewer rounds, down to 3 rounds of one run of each
        model), its time counted in profile_s; a model that `is` `source` runs in the search's source session
        (session_of)."""
        t = time.perf_counter()
        try:
            sessions = [self.session_of(m) if source is not None and m is source else cpu_session(m, WALL_THREADS)
                        for m in models]
            self.timed_sessions = [(m, sess) for m, sess in zip(models, sessions, strict=True)
                                   if source is None or m is not source]
            budget = min(WALL_BUDGET_S, max(0.0, self.deadline - time.perf_counter()))
            first: list[list[Any]] = []
            ms = wall_clock_ms(models, self.feeds or {}, rounds=WALL_ROUNDS, runs=WALL_RUNS, budget_s=budget,
                               settled=settled, threads=WALL_THREADS, sessions=sessions, first_outputs=first)
            for model, outputs in zip(models, first, strict=True):
                self.qgraph.keep_engine_run(EngineRun(model, dict(self.feeds or {}), WALL_THREADS, outputs))
            return ms
        finally:
            self.profile_s += time.perf_counter() - t

    def profile(self, float_set: set[str]) -> OrtProfile:
        t = time.perf_counter()
        self.profiles += 1
        model = self.build(float_set)
        prof = profile_onnx(model, self.feeds or {}, runs=PROFILE_RUNS, warmup=PROFILE_WARMUP)
        self.profile_s += time.perf_counter() - t
        return prof

    def settle(self, float_set: set[str]) -> set[str]:
        """`float_set` less the regions onnxruntime would run in INT8 anyway (analysis.profile.ort_requantizes, checked
        on the exported candidate; repeated, since each such region back in INT8 puts Q/DQ next to its neighbours);
        those are added to self.forced."""

        current = set(float_set)
        for _ in range(len(self.by_anchor)):
            if not current:
                break
            hit = ort_requantizes(self.build(current), current)
            if not hit:
                break
            self.forced |= hit
            current -= hit
        return current

    def profile_fp32(self) -> OrtProfile:
        from netquant.export.onnx_qdq import fp32_onnx

        t = time.perf_counter()
        self.profiles += 1
        prof = profile_onnx(fp32_onnx(self.qgraph), self.feeds or {}, runs=PROFILE_RUNS,
                            warmup=PROFILE_WARMUP)
        self.profile_s += time.perf_counter() - t
        return prof

    def update(self, prof: OrtProfile, float_set: set[str]) -> set[str]:
        """Refresh each region's time in its state in `prof`; returns the float regions onnxruntime ran in int8 anyway
        (its WeightBiasQuantization quantizes a float Conv / Gemm between a Dequantize and a Quantize, per-tensor)."""
        int8 = {a for a in self.by_anchor if a not in float_set}
        times = region_times(prof, self.nmap, self.region_of, int8)
        forced = set()
        for node, op_type in prof.op_types.items():
            if op_type in INT8_KERNEL_OPS:
                ref = self.nmap.resolve(prof, node)
                anchor = self.region_of.get(ref[1]) if ref is not None and ref[0] == "op" else None
                if anchor in float_set:
                    forced.add(anchor)
        for a in self.by_anchor:
            if a not in forced:
                (self.t32 if a in float_set else self.t8)[a] = times.get(a, 0.0)
        self.forced |= forced
        return forced

    def slower(self) -> set[str]:
        """Regions measured slower in INT8 beyond the noise margin (ties and noise keep INT8)."""
        return {a for a in self.by_anchor if self.t8.get(a, 0.0) > SLOWER_MARGIN * self.t32.get(a, math.inf) + SLOWER_MS}


def whole_model_timing(placement: Any, qgraph: Any) -> Any:
    """Placement's whole-model timing of the source FP32 model and of the file export writes
    (passes.quant_graph.WholeModelTiming), where it timed that file: every region INT8 (the INT8-first check's
    all_int8_wall_ms), or INT8 and float regions as decided (placed_wall_ms: the placed file's check, or the
    INT8-first check where only edge floats are float, both timed in the same rounds as the source); none quantized
    at run time, no attention rewrite; else None."""
    from netquant.export.onnx_qdq import quant_state
    from netquant.passes.quant_graph import WholeModelTiming

    m = placement.measured
    decisions = {r.decision for r in placement.regions}
    if not {"source_fp32_wall_ms", "timed_shapes"} <= m.keys() or qgraph.dynamic_ops or qgraph.attention_rewrite:
        return None
    if decisions - {WEIGHT_ONLY} == {"int8"} and "all_int8_wall_ms" in m:  # (weight-only edges: set before it)
        int8_ms = m["all_int8_wall_ms"]
    elif decisions - {WEIGHT_ONLY} == {"int8", "float"} and "placed_wall_ms" in m:
        int8_ms = m["placed_wall_ms"]
    else:
        return None
    return WholeModelTiming(float(m["source_fp32_wall_ms"]), float(int8_ms),
                            {k: tuple(int(d) for d in v) for k, v in m["timed_shapes"].items()}, WALL_THREADS,
                            quant_state(qgraph))
