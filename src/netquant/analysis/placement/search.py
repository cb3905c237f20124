"""The placement search (see the package docstring): place / search_placement and their decision tables."""

from __future__ import annotations

import math
import time
from typing import Any

import onnx

from netquant.analysis.placement.budget import AccuracyBudget, WideFactory
from netquant.analysis.placement.constants import (
    DEFAULT_MAX_LOSS,
    EDGE_MIN_GAIN,
    LOSS_NOISE,
    MAX_ROUNDS,
    MIN_TIME_S,
    MIN_WEIGHTS,
    PROFILE_AFTER_SHARE,
    REPORT_SHARE,
    SEARCH_MIN_S,
    SEARCH_SHARE,
    TIME_SHARE,
    WEIGHT_ONLY_MIN_WEIGHTS,
    WIDER_SHARE,
)
from netquant.analysis.placement.dynamic import choose_dynamic_and_attention
from netquant.analysis.placement.edges import (
    EDGE_OPS,
    EdgeFloat,
    edge_candidates,
    min_gain,
    region_weight_count,
)
from netquant.analysis.placement.files import apply_placement_file
from netquant.analysis.placement.inputs import host_info_dict, model_hash
from netquant.analysis.placement.measure import SearchState, clear_verdict
from netquant.analysis.placement.ranges import check_clipped_ranges
from netquant.analysis.placement.records import (
    FLOAT,
    INT8,
    WEIGHT_ONLY,
    WIDER,
    Placement,
    Reason,
    RegionDecision,
    significant,
)
from netquant.analysis.profile import OTHER, region_times
from netquant.analysis.regions import Region, find_regions, keep_float
from netquant.analysis.sensitivity import Sensitivity
from netquant.analysis.wider import widen
from netquant.errors import ExportError
from netquant.passes.quant_graph import QuantizedGraph
from netquant.passes.settings import Objective, QuantSettings
from netquant.platforms.platform import Validation


def applies(settings: QuantSettings, qgraph: QuantizedGraph) -> bool:
    """True when a placement file or an objective is set: onnxruntime CPU platforms are timed and budgeted, every
    other platform (its engine is not timed here) gets the accuracy budget alone."""
    return settings.placement_from is not None or settings.objective is not None


def timed(qgraph: QuantizedGraph) -> bool:
    """Whether placement measures speed for this platform (onnxruntime CPU, the engine profiled here)."""
    return qgraph.platform.validation is Validation.ONNXRUNTIME


def region_weights(qgraph: QuantizedGraph, regions: list[Region]) -> int:
    """The weight elements of all regions' ops (below MIN_WEIGHTS a timed platform's rules decide)."""
    return sum(int(qgraph.graph.initializers[i].numel()) for r in regions for op in r.ops
               for i in qgraph.graph.node(op).inputs if i in qgraph.graph.initializers)


def measures(qgraph: QuantizedGraph) -> bool:
    """Whether search_placement measures this graph's accuracy (a quantized region, a kept calibration batch, and on a
    timed platform at least MIN_WEIGHTS weights): else the rules decide and nothing is repaired either."""
    regions = find_regions(qgraph)
    if not regions or (qgraph.sample_inputs is None and not qgraph.validation_batches):
        return False
    return not timed(qgraph) or region_weights(qgraph, regions) >= MIN_WEIGHTS


def place(qgraph: QuantizedGraph, settings: QuantSettings, elapsed_s: float,
          source: onnx.ModelProto | None = None, wide: WideFactory | None = None) -> Placement | None:
    """Apply a placement to `qgraph` (in place): from settings.placement_from, else measured (search_placement).
    source: the user's FP32 model, the speed BALANCED / ACCURACY must not fall below (default: the cleaned graph).
    wide: builds the model calibrated in the platform's wider format (Platform.wider; None: no wider step)."""
    if settings.placement_from is not None:
        return apply_placement_file(qgraph, settings.placement_from, wide)
    if not applies(settings, qgraph):
        return None
    if settings.placement_time_s is not None:
        budget, search = settings.placement_time_s, None
    else:
        budget, search = max(MIN_TIME_S, TIME_SHARE * elapsed_s), max(SEARCH_MIN_S, SEARCH_SHARE * elapsed_s)
    return search_placement(qgraph, settings, time_budget_s=budget, source=source, wide=wide, search_s=search)



def decisions_of(s: SearchState, best: frozenset[str], sens: dict[str, Sensitivity],
               reason_of: Any, wide: frozenset[str] = frozenset(), wider_gain: dict[str, float] | None = None
               ) -> list[RegionDecision]:
    """One RegionDecision per region: float where in `best`, the wider format where in `wide`, with reason_of(anchor)
    and its times / losses."""
    out = []
    label = s.qgraph.platform.wider.label if s.qgraph.platform.wider is not None else None
    for r in s.regions:
        a, se = r.anchor, sens.get(r.anchor)
        t8, t32 = s.t8.get(a), s.t32.get(a)
        decision = FLOAT if a in best else WIDER if a in wide else WEIGHT_ONLY if a in s.weight_only else INT8
        g = (wider_gain or {}).get(a)
        out.append(RegionDecision(a, r.op_type, list(r.ops), decision,
                                  Reason.EDGE_WEIGHT_ONLY if decision == WEIGHT_ONLY else reason_of(a),
                                  None if t8 is None else round(t8, 4), None if t32 is None else round(t32, 4),
                                  se.only if se else None, se.all_but if se else None, se.gain if se else None,
                                  label if decision == WIDER else None, None if g is None else significant(g)))
    return out


def _budget_only(s: SearchState, budget: AccuracyBudget, placement: Placement, start: float, time_budget_s: float) -> Placement:
    """Platforms whose engine is not timed here: the regions the accuracy budget needs run in the platform's wider
    format (if it has one) or, where that is not enough, stay float; the rest INT8."""
    wide_set, floats = budget.fill_wider() if budget.has_wider() else (set(), budget.fill(set(), set()))
    best, wide = frozenset(floats), frozenset(wide_set)
    report_end = min(s.deadline, time.perf_counter() + REPORT_SHARE * time_budget_s)
    sens = budget.report(best | wide, report_end)
    gains = budget.wider_gains(sorted(wide | best), report_end) if wide else {}
    if wide:
        assert budget.wide is not None
        widen(s.qgraph, budget.wide, [s.by_anchor[a] for a in sorted(wide | best)])
    keep_float(s.qgraph, [s.by_anchor[a] for a in sorted(best)])
    engine = s.qgraph.platform.engine or f"{s.qgraph.platform.name}'s engine"  # LiteRT, ncnn, TensorRT, ...

    def reason_of(a: str) -> str:
        if a in wide:
            return Reason.WIDER
        if a in best:
            return Reason.WIDER_NOT_ENOUGH if budget.wide is not None else Reason.BUDGET
        return Reason.NOT_TIMED

    placement.regions = decisions_of(s, best, sens, reason_of, wide, gains)
    placement.measured = {"loss_all_int8": budget.loss_of.get(frozenset()),
                          "loss_placed": (budget.wide_loss(wide | best, best) if wide else budget.loss(best))
                          if budget.meter is not None else None,
                          "loss_passes": budget.meter.calls if budget.meter else 0,
                          "seconds": round(time.perf_counter() - start, 6)}
    if wide:
        placement.measured["loss_all_wider"] = budget.wide_loss_of.get((frozenset(s.by_anchor), frozenset()))
    placement.note = (f"speed not measured ({engine} is not timed here): the accuracy budget "
                      "alone decides" + ("" if budget.meter is not None else "; no budget (max_loss None): all INT8")
                      + (f"; {len(wide)} region(s) in the wider format ({s.qgraph.platform.wider.label}), the most "
                         f"sensitive first, until the loss is within {WIDER_SHARE} x max_loss"
                         if wide and s.qgraph.platform.wider is not None else ""))
    return placement


def edge_floats(s: SearchState, budget: AccuracyBudget, objective: Objective) -> dict[str, EdgeFloat]:
    """The edge regions (placement.edges) measured to save at least EDGE_MIN_GAIN of the all-INT8 loss when float
    (the budget's meter; BALANCED / ACCURACY only, LATENCY has no accuracy budget): kept float or weight-only where
    they save edges.min_gain, else (a table under BALANCED) recorded as an int8 table."""
    if objective is Objective.LATENCY or budget.meter is None:
        return {}
    candidates = edge_candidates(s.qgraph.graph, s.regions)
    if not candidates:
        return {}
    base = budget.loss(set())
    if base <= LOSS_NOISE:  # all INT8 already gives FP32's output to float precision: no float saves loss
        return {}
    out: dict[str, EdgeFloat] = {}
    for a, share in candidates.items():
        if s.settle({a}) != {a}:  # onnxruntime would quantize it anyway (or it drags others along)
            continue
        lf = budget.loss({a})
        r = s.by_anchor[a]
        if base - lf >= min_gain(r.op_type, objective) * base:
            lw = budget.weight_only_loss(a) if r.op_type in EDGE_OPS and \
                region_weight_count(s.qgraph.graph, r) >= WEIGHT_ONLY_MIN_WEIGHTS else None
            out[a] = EdgeFloat(a, share, base, lf, lw)
        elif base - lf >= EDGE_MIN_GAIN * base:
            out[a] = EdgeFloat(a, share, base, lf, int8_table=True)
    return out


def apply_weight_only(s: SearchState, budget: AccuracyBudget, anchors: frozenset[str]) -> None:
    """The edge regions `anchors` weight-only from here on (their activations float, weights int8): the state every
    later candidate, timing and loss starts from; the memoised losses and builds of the earlier state dropped."""
    if not anchors:
        return
    keep_float(s.qgraph, [s.by_anchor[a] for a in sorted(anchors)], weights=False)
    s.weight_only = anchors
    s.built.clear()
    budget.forget()


def _all_int8_unprofiled(s: SearchState, budget: AccuracyBudget, placement: Placement, measured: dict[str, Any], start: float,
                         time_budget_s: float, edge: frozenset[str] = frozenset()) -> Placement:
    """BALANCED / ACCURACY decided by the whole-model check (all INT8 no slower than the source, within the budget)
    when the cap leaves no time for per-region profiles: every region INT8 but the edge floats, times not
    profiled."""
    sens = budget.report(edge, min(s.deadline, time.perf_counter() + REPORT_SHARE * time_budget_s))
    keep_float(s.qgraph, [s.by_anchor[a] for a in sorted(edge)])
    placement.regions = decisions_of(s, edge, sens, lambda a: Reason.EDGE if a in edge else Reason.WHOLE_MODEL)
    if edge:  # the INT8-first check timed this very file (its edge floats float) against the source
        measured["placed_wall_ms"] = measured["all_int8_wall_ms"]
    measured.update({"speedup_vs_fp32": measured["source_fp32_wall_ms"] / max(measured["all_int8_wall_ms"], 1e-9),
                     "loss_all_int8": budget.loss_of.get(frozenset()), "loss_placed": budget.loss(edge),
                     "profiles": 0, "profile_s": s.profile_s, "loss_passes": budget.meter.calls if budget.meter else 0,
                     "seconds": time.perf_counter() - start})
    placement.measured = {k: (significant(v) if isinstance(v, float) else v) for k, v in measured.items()}
    placement.note = "; ".join(filter(None, [placement.note, "all INT8: no slower than the source model and within "
                                             "the budget; per-region times not profiled (time cap)",
                                             f"{len(edge)} edge region(s) float (measured['edge_floats'])" if edge
                                             else "",
                                             f"{len(s.weight_only)} edge region(s) weight-only" if s.weight_only
                                             else ""]))
    return placement


def search_placement(qgraph: QuantizedGraph, settings: QuantSettings, time_budget_s: float = 30.0,
                     source: onnx.ModelProto | None = None, wide: WideFactory | None = None,
                     search_s: float | None = None) -> Placement:
    """Measure and decide (module docstring); applies the decision to `qgraph` (keep_float) and returns it.
    Platforms other than onnxruntime CPU: the accuracy budget alone (_budget_only).
    search_s: the cap (default time_budget_s) where the whole-model check does not decide (INT8 slower than the
    source, over the budget, or LATENCY): the per-region profiles and rounds then make the decision itself.
    measured['time_cap_s'] is the cap in force (time_budget_s, or search_s where that raised it)."""
    placement = _search_placement(qgraph, settings, time_budget_s, source, wide, search_s)
    if placement.regions and "not measured" not in placement.note:
        placement.measured.setdefault("time_cap_s", round(time_budget_s, 3))
    return placement


def _search_placement(qgraph: QuantizedGraph, settings: QuantSettings, time_budget_s: float,
                      source: onnx.ModelProto | None, wide: WideFactory | None, search_s: float | None) -> Placement:
    start = time.perf_counter()
    objective = Objective.parse(settings.objective) if settings.objective is not None else Objective.BALANCED
    max_loss = settings.max_loss if settings.max_loss is not None else DEFAULT_MAX_LOSS[objective]
    metric_name = "user metric drop" if settings.metric is not None else "1 - output cosine"
    placement = Placement(model_hash(qgraph), qgraph.platform.name, str(getattr(qgraph.platform, "cpu_target", "")),
                          host_info_dict(), objective.value, max_loss, metric_name)
    s = SearchState(qgraph, settings, start + time_budget_s)
    if not s.regions or s.feeds is None:
        placement.note = "not measured: no quantized region" if not s.regions else "not measured: no calibration batch kept"
        placement.regions = [RegionDecision(r.anchor, r.op_type, list(r.ops), "int8", "rules (not measured)")
                             for r in s.regions]
        return placement
    if not timed(qgraph):
        return _budget_only(s, AccuracyBudget(s, max_loss, objective, wide), placement, start, time_budget_s)
    weights = region_weights(qgraph, s.regions)
    if weights < MIN_WEIGHTS:
        placement.note = (f"not measured: {weights} weights in all regions (< {MIN_WEIGHTS}), too small for per-op "
                          "timing; the platform's rules decide")
        placement.regions = [RegionDecision(r.anchor, r.op_type, list(r.ops), "int8", "rules (model too small)")
                             for r in s.regions]
        return placement

    all_anchors = set(s.by_anchor)
    measured: dict[str, Any] = {"timed_shapes": {k: list(v.shape) for k, v in (s.feeds or {}).items()}}
    budget = AccuracyBudget(s, max_loss, objective)
    ranges = check_clipped_ranges(budget)
    if ranges is not None:
        measured["matmul_ranges"] = ranges
    edges = edge_floats(s, budget, objective)
    edge = frozenset(a for a, e in edges.items() if e.floated)
    if edges:
        measured["edge_floats"] = {a: e.as_dict() for a, e in sorted(edges.items())}
    apply_weight_only(s, budget, frozenset(a for a, e in edges.items() if e.weight_only))
    # INT8 first (BALANCED, ACCURACY): the all-INT8 file is kept whole when it is no slower than the user's FP32
    # model, timed interleaved without the profiler (whose per-node overhead weighs on the Q/DQ-rich INT8 graph);
    # with the edge floats float (decided above, from the model and data alone): the file that ships if it is kept
    int8_first_ok = False
    if source is not None and objective is not Objective.LATENCY:
        try:
            src_ms, all8_ms = s.wall_clock([source, s.build(set(edge))], settled=clear_verdict, source=source)
        except ExportError as exc:  # the source does not run in onnxruntime: compare with the cleaned FP32 graph
            placement.note = f"source model not timed ({str(exc).splitlines()[0][:200]}); FP32 = the cleaned graph"
        else:
            measured.update({"source_fp32_wall_ms": src_ms, "all_int8_wall_ms": all8_ms})
            int8_first_ok = all8_ms <= src_ms
    if int8_first_ok and (max_loss is None or budget.loss(set()) <= max_loss) and \
            time.perf_counter() > start + PROFILE_AFTER_SHARE * time_budget_s:
        # decided (all INT8, within the budget); the per-region profiles would only inform the report: not within
        # the cap
        placement = _all_int8_unprofiled(s, budget, placement, measured, start, time_budget_s, edge)
        return choose_dynamic_and_attention(s, placement, source, max_loss, search_s or time_budget_s)
    if search_s is not None and not (int8_first_ok and (max_loss is None or budget.loss(set()) <= max_loss)):
        s.deadline = max(s.deadline, start + search_s)
    p32 = s.profile_fp32()
    s.update(p32, all_anchors)
    p8 = s.profile(set())
    s.update(p8, set())
    measured.update({"fp32_ms": p32.node_total_ms, "all_int8_ms": p8.node_total_ms})
    candidates: list[tuple[float, frozenset[str]]] = [(p8.node_total_ms, frozenset())]
    fp32_ms = p32.node_total_ms

    def speed_floats(slower: set[str], int8_ms: float) -> set[str]:
        """LATENCY: every region measured slower in INT8. BALANCED / ACCURACY (INT8 first: the model really in
        INT8): only the slowest of those, most INT8 excess first, until the model is no slower than FP32."""
        if objective is Objective.LATENCY:
            return set(slower)
        if int8_first_ok:
            return set()
        chosen: set[str] = set()
        for a in sorted(slower, key=lambda a: (-(s.t8.get(a, 0.0) - s.t32.get(a, 0.0)), a)):
            if int8_ms <= fp32_ms:
                break
            chosen.add(a)
            int8_ms -= s.t8.get(a, 0.0) - s.t32.get(a, 0.0)
        return chosen

    # the accuracy decision first, from the model and data alone (no timing, no clock: AccuracyBudget): the regions
    # the budget floats on top of all INT8, settled structurally (a float onnxruntime would re-quantize is no float)
    budget_float = budget.fill(set(), set())
    for _ in range(len(all_anchors)):
        settled = s.settle(budget_float)
        if settled == budget_float:
            break
        budget_float = settled | budget.fill(settled, s.forced)
    budget_float = frozenset(budget_float)
    float_speed = s.settle(speed_floats(s.slower(), p8.node_total_ms))
    # iterate on the candidate: the speed floats follow the timings, the budget's floats stay
    current = s.settle(float_speed | budget_float)
    seen = {frozenset()}
    rounds = 0
    while rounds < MAX_ROUNDS and frozenset(current) not in seen and time.perf_counter() < s.deadline \
            and current != all_anchors:
        seen.add(frozenset(current))
        prof = s.profile(current)
        rounds += 1
        forced = s.update(prof, current)
        if not forced:  # a candidate onnxruntime re-quantized is not the model we would ship
            candidates.append((prof.node_total_ms, frozenset(current)))
        speed = s.settle(speed_floats(s.slower() - s.forced, p8.node_total_ms))
        current = s.settle(speed | budget_float)
    if current == all_anchors and frozenset(current) not in seen:
        candidates.append((p32.node_total_ms, frozenset(current)))
    elif frozenset(current) not in seen:  # decided but not profiled (time cap): the all-INT8 profile's total with
        # the floated regions' FP32 times in place of their INT8 times
        estimate = p8.node_total_ms + sum(s.t32.get(a, 0.0) - s.t8.get(a, 0.0) for a in current)
        candidates.append((estimate, frozenset(current)))
        measured["placed_ms_estimated"] = 1
    ok = [(t, fl) for t, fl in candidates if max_loss is None or budget.loss(fl) <= max_loss]
    if not ok:  # the budget's candidate was not profiled (time cap): its time is the sum of its regions' times
        current = s.settle(current)
        ok = [(p8.node_total_ms + sum(s.t32.get(a, 0.0) - s.t8.get(a, 0.0) for a in current), frozenset(current))]
        measured["placed_ms_estimated"] = 1
    if objective is Objective.LATENCY:
        best_t, best = min(ok, key=lambda c: (round(c[0], 6), len(c[1]), sorted(c[1])))
    else:  # INT8 first: the candidate with the fewest float regions among those no slower than FP32; where none
        # is (the time cap cut the search short), the fastest measured
        fast = ok if int8_first_ok else [c for c in ok if c[0] <= fp32_ms]
        best_t, best = (min(fast, key=lambda c: (len(c[1]), round(c[0], 6), sorted(c[1]))) if fast
                        else min(ok, key=lambda c: (round(c[0], 6), len(c[1]), sorted(c[1]))))
    placed_float = best
    if objective is not Objective.LATENCY and "source_fp32_wall_ms" in measured and not int8_first_ok and \
            best != all_anchors:
        # the profiles' per-node sums miss onnxruntime's per-node overhead, which the Q/DQ boundaries of a mixed file
        # add to: the decision, timed like the INT8-first check against the source, must be no slower than the
        # source, else the faster of it and the all-float file (timed against each other) ships
        assert source is not None  # it was timed
        src_ms, placed_ms = s.wall_clock([source, s.build(set(best))], source=source)
        measured.update({"source_fp32_wall_ms": src_ms, "placed_wall_ms": placed_ms})
        float_ms = math.inf
        if placed_ms > src_ms:
            placed_again_ms, float_ms = s.wall_clock([s.build(set(best)), s.build(all_anchors)])
            measured["all_float_wall_ms"] = float_ms
            placed_ms = placed_again_ms
        if float_ms < placed_ms:
            placed_float, best, best_t = best, frozenset(all_anchors), p32.node_total_ms
            placement.note = "; ".join(filter(None, [placement.note, "the placed file timed slower than the source: "
                                                     "every region float (INT8 does not pay off on this CPU)"]))
    if edge:  # the edge floats on top of the choice (a small share of the time; none under LATENCY)
        best, placed_float = frozenset(best | edge), frozenset(placed_float | edge)
    final_loss = budget.loss(best) if budget.meter is not None else None
    sens = budget.report(best, min(s.deadline, time.perf_counter() + REPORT_SHARE * time_budget_s))
    keep_float(qgraph, [s.by_anchor[a] for a in sorted(best)])
    slower = s.slower()

    def reason_of(a: str) -> str:
        if a in best and a not in placed_float:
            return Reason.ALL_FLOAT
        if a in edge and a in best:
            return Reason.EDGE
        if a in best:
            return Reason.BUDGET if a in budget_float else Reason.SLOWER
        if a in s.forced:
            return Reason.FORCED
        if a not in slower:
            return Reason.FASTER
        return "fastest measured candidate" if objective is Objective.LATENCY else Reason.KEPT

    placement.regions = decisions_of(s, best, sens, reason_of)
    measured.update({"placed_ms": best_t, "speedup_vs_fp32": p32.node_total_ms / best_t if best_t else 0.0,
                     "other_fp32_ms": region_times(p32, s.nmap, s.region_of, set()).get(OTHER, 0.0),
                     "loss_all_int8": budget.loss_of.get(frozenset()), "loss_placed": final_loss,
                     "profiles": s.profiles, "profile_s": s.profile_s,
                     "loss_passes": budget.meter.calls if budget.meter else 0,
                     "rounds": rounds, "seconds": time.perf_counter() - start})
    if int8_first_ok and not best:  # the shipped file is the all-INT8 one timed against the source: that ratio
        measured["speedup_vs_fp32"] = measured["source_fp32_wall_ms"] / max(measured["all_int8_wall_ms"], 1e-9)
    placement.measured = {k: (significant(v) if isinstance(v, float) else v) for k, v in measured.items()}
    # the cap in force (search_s may have raised it); repair.place_with_repair compares it with the time really taken
    placement.measured["time_cap_s"] = round(s.deadline - start, 3)
    return choose_dynamic_and_attention(s, placement, source, max_loss, search_s or time_budget_s)

