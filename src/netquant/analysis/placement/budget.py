"""The accuracy budget of a placement search: the fake-quant loss of a float set and the greedy choice of regions
to keep float (or in the platform's wider format) until it is within max_loss."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from netquant.analysis.placement.constants import LOSS_NOISE, RANKED_REGIONS, SENSITIVITY_SAMPLES, WIDER_SHARE
from netquant.analysis.placement.inputs import first_samples
from netquant.analysis.placement.measure import SearchState
from netquant.analysis.regions import keep_float
from netquant.analysis.sensitivity import LossMeter, Sensitivity, region_output_nsr, region_sensitivity
from netquant.analysis.wider import check_twin, widen
from netquant.errors import ConfigError
from netquant.passes.quant_graph import QuantizedGraph
from netquant.passes.settings import Effort, Objective, QuantSettings
from netquant.platforms.threads import thread_scope

# the wide-format graph of a model (the same model calibrated with Platform.widened()), built when first needed
WideFactory = Callable[[], QuantizedGraph]


def wide_graph(qgraph: QuantizedGraph, wide: WideFactory | None, what: str) -> QuantizedGraph:
    """The wide-format twin of `qgraph` from `wide` (ConfigError naming `what` when there is none)."""
    if wide is None or qgraph.platform.wider is None:
        raise ConfigError(f"{what} runs regions in the wider format, but platform '{qgraph.platform.name}' has none "
                          "here (Platform.wider; the calibration data must be a list, not a one-shot stream)")
    twin = wide()
    check_twin(qgraph, twin)
    return twin


def budget_data(qgraph: QuantizedGraph, settings: QuantSettings) -> list:
    """The data the budget's loss runs on: eval_data (with a metric), else the first SENSITIVITY_SAMPLES samples of
    the first kept calibration batch."""
    if settings.eval_data is not None:
        return list(settings.eval_data)
    return [first_samples(b, qgraph, SENSITIVITY_SAMPLES)
            for b in (qgraph.validation_batches[:1] or [qgraph.sample_inputs])]


def loss_meter(qgraph: QuantizedGraph, settings: QuantSettings, data: list | None = None) -> LossMeter:
    """A LossMeter of `qgraph` on the budget's data, built on one torch thread (see AccuracyBudget)."""
    with thread_scope(1):
        return LossMeter(qgraph, budget_data(qgraph, settings) if data is None else data, settings.metric)


def meter_loss(meter: LossMeter, regions: list) -> float:
    """meter.loss(regions) on one torch thread: the reductions' order, and so the loss to the last bit, is the same
    whatever thread count the caller or the machine's load gave torch."""
    with thread_scope(1):
        return meter.loss(regions)


@dataclass(frozen=True)
class AllInt8Loss:
    """A meter on the budget's data (loss_meter) and its all-INT8 loss, measured on `qgraph` in quantization state
    `state` (export.onnx_qdq.quant_state) under `settings`."""

    qgraph: QuantizedGraph
    settings: QuantSettings
    state: tuple[Any, ...]
    meter: LossMeter
    loss: float


_LAST: list[AllInt8Loss] = []  # at most one: the plain graph's, from measure_all_int8 until the budget takes it


def measure_all_int8(qgraph: QuantizedGraph, settings: QuantSettings) -> float:
    """The all-INT8 loss of `qgraph` on the budget's data (a new loss_meter, meter_loss(meter, [])); the meter and the
    loss are kept for the AccuracyBudget of the same graph and settings (take_all_int8): the same model, data and
    one torch thread give the same loss to the bit, so the budget builds no second meter and runs no second pass."""
    from netquant.export.onnx_qdq import quant_state

    meter = loss_meter(qgraph, settings)
    loss = meter_loss(meter, [])
    _LAST[:] = [AllInt8Loss(qgraph, settings, quant_state(qgraph), meter, loss)]
    return loss


def take_all_int8(qgraph: QuantizedGraph, settings: QuantSettings) -> AllInt8Loss | None:
    """measure_all_int8's result where it was measured on this very graph (unchanged since) and settings object; the
    slot is emptied either way."""
    from netquant.export.onnx_qdq import quant_state

    got = _LAST.pop() if _LAST else None
    if got is None or got.qgraph is not qgraph or got.settings is not settings or got.state != quant_state(qgraph):
        return None
    return got


class AccuracyBudget:
    """The accuracy budget of one search: the fake-quant loss of a float set (memoised; 0 without a budget) and the
    greedy choice of regions to float until it is within max_loss.

    Its decisions depend on the model, the data and settings.effort only, never on timings or a clock: losses are
    measured on one torch thread; the regions are ranked by their measured gain (the loss floating each saves),
    measured for the RANKED_REGIONS[effort] noisiest regions (output NSR, every region for MAX) whatever the time
    cap; regions not measured rank after every region with a positive measured gain, by their NSR."""

    def __init__(self, s: SearchState, max_loss: float | None, objective: Objective,
                 wide: WideFactory | None = None) -> None:
        self.s = s
        self.max_loss = max_loss
        self.objective = objective
        self.wide_factory = wide if s.qgraph.platform.wider is not None else None
        self.wide: QuantizedGraph | None = None
        self.loss_of: dict[frozenset[str], float] = {}
        self.wide_loss_of: dict[tuple[frozenset[str], frozenset[str]], float] = {}
        self.marginal: dict[str, Sensitivity] = {}
        self.local: dict[str, float] = {}
        self.meter: LossMeter | None = None
        if max_loss is not None:
            known = take_all_int8(s.qgraph, s.settings)  # try_repairs measured it already: no second meter or pass
            self.meter = known.meter if known is not None else loss_meter(s.qgraph, s.settings)
            if known is not None:
                self.loss_of[frozenset()] = known.loss

    def loss(self, fl: set[str] | frozenset[str]) -> float:
        key = frozenset(fl)
        if self.meter is None:
            return 0.0
        if key not in self.loss_of:
            self.loss_of[key] = meter_loss(self.meter, [self.s.by_anchor[a] for a in sorted(fl)])
        return self.loss_of[key]

    def weight_only_loss(self, anchor: str) -> float:
        """The loss with the region `anchor` weight-only (its activations float, its weights quantized), the rest as
        they are (not memoised)."""
        if self.meter is None:
            return 0.0
        with keep_float(self.s.qgraph, [self.s.by_anchor[anchor]], weights=False):
            return self.loss_of_meter(set())

    def forget(self) -> None:
        """Drop the memoised losses (the quantized graph's state changed under them)."""
        self.loss_of.clear()
        self.wide_loss_of.clear()
        self.marginal.clear()
        self.local.clear()

    def wide_loss(self, wide: set[str] | frozenset[str], fl: set[str] | frozenset[str] = frozenset()) -> float:
        """The loss with the regions `wide` in the wider format and `fl` in float (memoised)."""
        if not wide:
            return self.loss(fl)
        key = (frozenset(wide), frozenset(fl))
        if self.meter is None:
            return 0.0
        if key not in self.wide_loss_of:
            if self.wide is None:
                self.wide = wide_graph(self.s.qgraph, self.wide_factory, "the accuracy budget")
            with widen(self.s.qgraph, self.wide, [self.s.by_anchor[a] for a in sorted(wide)]):
                self.wide_loss_of[key] = self.loss_of_meter(fl)
        return self.wide_loss_of[key]

    def loss_of_meter(self, fl: set[str] | frozenset[str]) -> float:
        assert self.meter is not None
        return meter_loss(self.meter, [self.s.by_anchor[a] for a in sorted(fl)])

    def has_wider(self) -> bool:
        return self.wide_factory is not None and self.meter is not None and self.max_loss is not None

    def fill_wider(self) -> tuple[set[str], set[str]]:
        """(wide, float) for platforms with a wider format; nothing when all regions in the platform's own format are
        within WIDER_SHARE x max_loss.

        Each region's wider gain, loss(all narrow) - loss(only it wide), orders the regions (most first); the wide set
        is the shortest prefix of that order within WIDER_SHARE x max_loss, bisected (the loss falls as the prefix
        grows) among the regions the gain helps, else among all of them; where neither the helped regions nor all
        reach it, the lower-loss of those two. Where that is still above max_loss, regions go float on top in the
        budget's greedy order (the most loss saved first) until it is within."""
        assert self.max_loss is not None
        target = WIDER_SHARE * self.max_loss
        base = self.loss(set())
        if base <= target:
            return set(), set()
        gain = {a: base - self.wide_loss({a}) for a in sorted(self.s.by_anchor)}
        order = sorted(gain, key=lambda a: (-gain[a], a))
        helped = sum(gain[a] > 0 for a in order) or len(order)

        def within(k: int) -> bool:
            return self.wide_loss(set(order[:k])) <= target

        if within(helped):
            lo, hi = 1, helped
        elif within(len(order)):
            lo, hi = helped + 1, len(order)
        else:
            best = min((helped, len(order)), key=lambda k: (self.wide_loss(set(order[:k])), k))
            lo = hi = best
        while lo < hi:  # the shortest prefix within the target
            mid = (lo + hi) // 2
            if within(mid):
                hi = mid
            else:
                lo = mid + 1
        wide = set(order[:hi])
        extra: set[str] = set()
        if self.wide_loss(wide) > self.max_loss:
            self.rank(sorted(self.s.by_anchor), set())
            for a in sorted(self.s.by_anchor, key=lambda a: (-self.score(a)[0], a)):
                if self.wide_loss(wide | extra, extra) <= self.max_loss:
                    break
                extra.add(a)
        return wide - extra, extra

    def wider_gains(self, anchors: list[str], deadline: float) -> dict[str, float]:
        """loss(all narrow) - loss(only that region wide) for `anchors`, until `deadline`."""
        out: dict[str, float] = {}
        for a in anchors:
            if time.perf_counter() > deadline:
                break
            out[a] = self.loss(set()) - self.wide_loss({a})
        return out

    def saved_ms(self, a: str) -> float:
        """What keeping `a` in float saves in time (0 where not timed)."""
        return self.s.t32.get(a, 0.0) - self.s.t8.get(a, 0.0)

    def score(self, a: str) -> tuple[int, float, str]:
        """Greedy order (highest first): a region whose measured gain (the loss floating it saves vs all INT8) is
        positive, by that gain; then the others by their output's noise-to-signal ratio. No timing enters it."""
        se = self.marginal.get(a)
        if se is not None and se.gain is not None and se.gain > 0:
            return 1, se.gain, a
        return 0, self.local.get(a, 0.0), a

    def fill(self, fixed: set[str], exclude: set[str]) -> set[str]:
        """Regions to float on top of `fixed`, best score first, until the loss is within max_loss."""
        s, extra = self.s, set()
        if self.meter is None or self.max_loss is None:
            return extra
        while self.loss(fixed | extra) > self.max_loss:
            left = [a for a in sorted(s.by_anchor) if a not in fixed | extra | exclude]
            if not left:
                break
            self.rank(left, fixed)
            extra.add(max(left, key=self.score))
        return extra

    def rank(self, left: list[str], fixed: set[str]) -> None:
        """Measure what floating each of the RANKED_REGIONS[effort] noisiest of `left` saves on top of `fixed` (once,
        when the budget first needs it; no deadline: a fixed amount of work)."""
        if self.marginal or self.meter is None:
            return
        s = self.s
        with thread_scope(1):
            self.local.update(region_output_nsr(self.meter, s.regions))
        limit = RANKED_REGIONS[Effort.parse(s.settings.effort)]
        order = sorted(left, key=lambda a: (-self.local.get(a, 0.0), a))
        measured = [s.by_anchor[a] for a in order[:len(order) if limit is None else limit]]
        with thread_scope(1):
            self.marginal.update(region_sensitivity(self.meter, measured, [s.by_anchor[a] for a in sorted(fixed)],
                                                    only=False)[1])

    def report(self, best: frozenset[str], deadline: float) -> dict[str, Sensitivity]:
        """Each region's sensitivity (vs all INT8) for the report, placed regions first, until `deadline`."""
        sens: dict[str, Sensitivity] = {}
        if self.meter is None or (self.meter.metric is None and self.loss(set()) <= LOSS_NOISE):
            return sens  # (output-cosine gains at float noise would say nothing)
        everything = set(self.s.by_anchor)
        for r in sorted(self.s.regions, key=lambda r: (r.anchor not in best, r.anchor)):
            if time.perf_counter() > deadline:
                break
            all_but = self.loss({r.anchor})
            only = self.loss(everything - {r.anchor}) if time.perf_counter() <= deadline else None
            sens[r.anchor] = Sensitivity(only, all_but, self.loss(set()) - all_but)
        return sens

