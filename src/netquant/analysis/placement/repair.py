"""Repair before float: when the all-INT8 model is over the accuracy budget, placement first quantizes it again with
the cheapest repair that brings the all-INT8 loss within max_loss, and floats only what repair cannot fix.

The repairs are the passes users can give quantize_onnx(passes=...) themselves; each is tried alone on the plain
model, cheapest first (one more PTQ run and one loss pass each), in a fixed list per Effort:
- FAST: none (today's placement: float what the budget needs);
- DEFAULT: cross-layer equalization (passes.equalization), then bias correction (passes.bias_correction) where the
  platform and the settings have it off;
- MAX: those, then SmoothQuant (passes.smoothquant), AdaRound (passes.adaround) and the chain equalization +
  SmoothQuant + AdaRound.
The loss is the budget's (analysis.placement.budget: the user's metric drop on eval_data, else 1 - output cosine on
the budget's calibration samples; one torch thread). The first repair within max_loss ships; where none is, the one
with the lowest loss ships if it is lower than the plain model's (the budget then floats regions on top of it), else
the plain model. No clock enters the choice: the same model, data, settings and effort give the same repair.

Every repair here is global (it rewrites every region it applies to): the placement records it per model
(Placement.repairs: the loss before and after, kept or not, its seconds).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx

from netquant.analysis.placement.budget import (
    WideFactory,
    budget_data,
    loss_meter,
    measure_all_int8,
    meter_loss,
    take_all_int8,
)
from netquant.analysis.placement.constants import DEFAULT_MAX_LOSS
from netquant.analysis.placement.files import apply_placement_file
from netquant.analysis.placement.inputs import model_hash
from netquant.analysis.placement.records import Placement, RepairTrial, significant
from netquant.analysis.placement.search import applies, measures, place
from netquant.errors import ConfigError
from netquant.passes.adaround import AdaRoundPass
from netquant.passes.base import PassBase
from netquant.passes.equalization import EqualizationPass
from netquant.passes.quant_graph import QuantizedGraph
from netquant.passes.settings import Effort, Objective, QuantSettings
from netquant.passes.smoothquant import SmoothQuantPass

# quantizes the model again, from the source, with these extra passes and settings (objective None: no placement)
Requantize = Callable[[Sequence[PassBase], Mapping[str, Any]], QuantizedGraph]

EQUALIZATION, BIAS_CORRECTION, SMOOTHQUANT, ADAROUND = "equalization", "bias correction", "smoothquant", "adaround"
CHAIN = "equalization + smoothquant + adaround"


@dataclass(frozen=True)
class Repair:
    """One repair option: the passes it adds and the settings it changes."""

    name: str
    passes: Callable[[], list[PassBase]]
    settings: Mapping[str, Any] = field(default_factory=dict)


REPAIRS: dict[str, Repair] = {r.name: r for r in (
    Repair(EQUALIZATION, lambda: [EqualizationPass()]),
    Repair(BIAS_CORRECTION, lambda: [], {"bias_correction": True}),
    Repair(SMOOTHQUANT, lambda: [SmoothQuantPass()]),
    Repair(ADAROUND, lambda: [AdaRoundPass()]),
    Repair(CHAIN, lambda: [EqualizationPass(), SmoothQuantPass(), AdaRoundPass()]),
)}
ORDER: dict[Effort, tuple[str, ...]] = {
    Effort.FAST: (),
    Effort.DEFAULT: (EQUALIZATION, BIAS_CORRECTION),
    Effort.MAX: (EQUALIZATION, BIAS_CORRECTION, SMOOTHQUANT, ADAROUND, CHAIN),
}


def repair_options(settings: QuantSettings, given: Sequence[str] = ()) -> list[Repair]:
    """The repairs to try, cheapest first (ORDER[effort]), less those already in force: bias correction where the
    settings or the platform turn it on, a pass the user gave (by its name in `given`)."""
    out = []
    for name in ORDER[Effort.parse(settings.effort)]:
        repair = REPAIRS[name]
        if name == BIAS_CORRECTION and (settings.bias_correction is not None or settings.platform.bias_correction):
            continue
        if any(p.name in given for p in repair.passes()):
            continue
        out.append(repair)
    return out


def _budget(settings: QuantSettings) -> float | None:
    objective = Objective.parse(settings.objective) if settings.objective is not None else Objective.BALANCED
    return settings.max_loss if settings.max_loss is not None else DEFAULT_MAX_LOSS[objective]


def try_repairs(qgraph: QuantizedGraph, settings: QuantSettings, requantize: Requantize,
                given: Sequence[str] = ()) -> tuple[QuantizedGraph, list[RepairTrial]]:
    """(the graph to place, the repairs tried) per the module docstring; `qgraph` itself when its all-INT8 loss is
    within the budget, no repair applies, or none lowers the loss."""
    max_loss = _budget(settings)
    options = repair_options(settings, given)
    if max_loss is None or not options or not measures(qgraph):
        return qgraph, []
    data = budget_data(qgraph, settings)
    before = measure_all_int8(qgraph, settings)  # kept for the budget of this graph (take_all_int8)
    if before <= max_loss:
        return qgraph, []
    trials: list[RepairTrial] = []
    best: tuple[float, int, QuantizedGraph] | None = None  # the lowest loss so far (the cheapest of equals)
    for i, repair in enumerate(options):
        t = time.perf_counter()
        repaired = requantize(repair.passes(), repair.settings)
        after = significant(meter_loss(loss_meter(repaired, settings, data), []))
        trials.append(RepairTrial(repair.name, significant(before), after, False, round(time.perf_counter() - t, 3)))
        if best is None or after < best[0]:
            best = (after, i, repaired)  # only the best graph is kept in memory
        if after <= max_loss:
            break
    assert best is not None
    if best[0] >= significant(before):
        return qgraph, trials
    take_all_int8(qgraph, settings)  # the plain graph is not placed: its meter is not kept
    trials[best[1]] = dataclasses.replace(trials[best[1]], kept=True)
    return best[2], trials


def place_with_repair(qgraph: QuantizedGraph, settings: QuantSettings, elapsed_s: float,
                      source: onnx.ModelProto | None = None, wide: WideFactory | None = None,
                      requantize: Requantize | None = None, given: Sequence[str] = ()
                      ) -> tuple[Placement | None, QuantizedGraph]:
    """analysis.placement.search.place after the repairs (try_repairs; none without `requantize`, or on a platform
    with a wider format, whose twin is calibrated without them); returns the placement and the graph it placed
    (the repaired one where a repair was kept). A placement file that names a kept repair is re-applied on the model
    quantized again with it. Placement.measured['seconds'] is the whole of placement's time; where it exceeds the
    latency measurements' cap, the note says both."""
    start = time.perf_counter()
    digest = None
    if settings.placement_from is not None:
        loaded = Placement.load(settings.placement_from)
        name = loaded.kept_repair()
        if name is not None:
            if requantize is None or name not in REPAIRS:
                raise ConfigError(f"placement file '{settings.placement_from}' was made with the repair '{name}', "
                                  "which cannot be re-applied here; measure again (drop placement_from)")
            digest = model_hash(qgraph)
            qgraph = requantize(REPAIRS[name].passes(), REPAIRS[name].settings)
        return apply_placement_file(qgraph, settings.placement_from, wide, digest=digest), qgraph
    if not applies(settings, qgraph):
        return None, qgraph
    trials: list[RepairTrial] = []
    if requantize is not None and qgraph.platform.wider is None:
        plain = qgraph
        qgraph, trials = try_repairs(qgraph, settings, requantize, given)
        if qgraph is not plain:
            digest = model_hash(plain)  # placement files refer to the model as given, the repair is recorded
    placement = place(qgraph, settings, elapsed_s, source=source, wide=wide)
    take_all_int8(qgraph, settings)  # where the search built no budget, the kept meter goes now
    if placement is None:
        return None, qgraph
    placement.repairs = trials
    if digest is not None:
        placement.model_sha256 = digest
    took = time.perf_counter() - start
    placement.measured["seconds"] = round(took, 3)
    cap = placement.measured.get("time_cap_s")
    if isinstance(cap, (int, float)) and took > cap:
        passes = placement.measured.get("loss_passes", 0)
        placement.note = "; ".join(filter(None, [placement.note, (
            f"time cap {cap:.2f} s reached: placement took {took:.2f} s in all (the cap bounds latency "
            "measurements; the whole-model timings and the FP32 and all-INT8 profiles always run, and the accuracy "
            f"work ({passes} loss passes" + (f", {len(trials)} repair(s)" if trials else "") +
            ") follows effort, not the clock)")]))
    return placement, qgraph
