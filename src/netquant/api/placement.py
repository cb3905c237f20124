"""Automatic placement: each region runs in INT8 only where that is faster in onnxruntime here and accurate enough.

The algorithm (`search_placement`), deterministic for a given set of measurements:
1. regions: analysis.regions.find_regions of the quantized graph (each Conv / MatMul / Gemm with the quantized ops
   that ride on it);
2. measure: profile the FP32 graph and the all-INT8 QDQ export in onnxruntime (CPU, batch 1, one thread; per-node
   medians) and charge each node, with its Q/DQ and layout glue, to a region (analysis.profile): fp32_ms and
   int8_ms per region;
3. speed: a region is "slower" where int8_ms > 1.05 fp32_ms + 2 us (the profiler's noise). LATENCY keeps every
   slower region float; BALANCED and ACCURACY put the model really in INT8: they float only the slower regions
   needed (largest INT8 excess first) for the model to be no slower than FP32, the rest stay INT8;
4. accuracy budget (analysis.sensitivity): while the fake-quant output loss of the placement exceeds max_loss, keep
   in float the INT8 region with the highest score: its gain (loss(all INT8) - loss(all but it)) per millisecond it
   saves (BALANCED) or its gain alone (ACCURACY);
5. iterate: export the candidate, profile it, refresh each region's time in its current state (its glue changes
   with its neighbours), decide step 3 again; stop when nothing changes, after MAX_ROUNDS or at the time cap;
6. keep, among the measured candidates that meet the budget (the all-INT8 graph included), the fastest (LATENCY) or
   the one with the fewest float regions that is no slower than FP32 (BALANCED, ACCURACY; the fastest where none is).
7. static or dynamic (onnxruntime, `_choose_dynamic`): the INT8 MatMul regions are profiled once more with their
   activation quantized at run time (export.dynamic: DynamicQuantizeLinear + MatMulInteger, onnxruntime's
   DynamicQuantizeMatMul); regions clearly faster so are the per-region choice; the all-static file, the
   all-dynamic one and the per-region choice are then timed against each other (wall clock) and the fastest whose
   onnxruntime output is as close to the source's as the static file's (or within max_loss) ships: decision
   DYNAMIC, with each region's dynamic_ms in the placement file.

BALANCED / ACCURACY first time the all-INT8 file against the user's FP32 model (wall clock, interleaved, within
WALL_BUDGET_S); when it is no slower and within the budget that decides, and steps 2-6 run only while the time cap
(TIME_SHARE of the quantization time, at least MIN_TIME_S) leaves room for them. Where it does not decide (and for
LATENCY) steps 2-6 make the decision, within SEARCH_SHARE of the quantization time, at least SEARCH_MIN_S. Platforms whose engine is not timed
here get step 4 alone (`_budget_only`); where the platform names a wider integer format (Platform.wider: QNN HTP's
uint16 activations, int8 for a 4-bit scheme), the regions the budget needs run in that format first (the most
sensitive first, as many as the budget needs), and only if every region wide is still not within max_loss do the
most sensitive ones go float (analysis.wider).

The result is a `Placement`, saved as JSON (`Placement.save`) and re-applied without measuring (`placement_from`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from netquant.analysis.attention import place_attention, rewrite_from_dict
from netquant.analysis.profile import (
    OTHER,
    NodeMap,
    OrtProfile,
    ort_requantizes,
    profile_onnx,
    region_times,
    wall_clock_ms,
)
from netquant.analysis.regions import find_regions, keep_float
from netquant.analysis.sensitivity import LossMeter, Sensitivity, region_output_nsr, region_sensitivity
from netquant.analysis.wider import check_twin, widen
from netquant.atomic import write_text_atomic
from netquant.errors import ConfigError, ExportError
from netquant.export.ort_kernels import INT8_KERNEL_OPS
from netquant.passes.quant_graph import QuantizedGraph
from netquant.passes.settings import Objective, QuantSettings
from netquant.platforms.platform import Validation

FORMAT = "netquant.placement/1"
MAX_ROUNDS = 3
DEFAULT_MAX_LOSS = {Objective.BALANCED: 0.02, Objective.ACCURACY: 0.005, Objective.LATENCY: None}
MIN_WEIGHTS = 20_000  # below this many weight elements in all regions, per-op timing is noise: rules only
MIN_TIME_S = 0.25
TIME_SHARE = 0.15  # default cap: this share of the quantization time before placement (at least MIN_TIME_S)
SEARCH_MIN_S, SEARCH_SHARE = 1.5, 0.5  # the cap where the per-region search decides (INT8 slower than the source,
# over the budget, LATENCY): half the quantization time, at least 1.5 s (a few profiles of a small model)
REPORT_SHARE = 0.25  # share of the cap the report's extra sensitivities may use
PROFILE_AFTER_SHARE = 0.5  # all INT8 decided by the whole-model check after this share of the cap: no profiles
PROFILE_RUNS, PROFILE_WARMUP = 5, 1  # per-node medians of 5 batch-1 runs (20 runs cost 3x the time)
WALL_ROUNDS, WALL_RUNS = 5, 3  # INT8-first check: 5 interleaved rounds of 3 runs per model ...
WALL_BUDGET_S = 1.0  # ... fewer runs per round (at least 1) for models whose runs would take longer
WALL_CLEAR = 0.15  # ... and 3 rounds only when INT8 is this much faster or slower than FP32 by then
SLOWER_MARGIN, SLOWER_MS = 1.05, 0.002  # INT8 counts as slower above 1.05 x FP32 + 2 us (profiler noise)
SENSITIVITY_SAMPLES = 4  # calibration samples the fake-quant loss is measured on
# platforms with a wider format (Platform.wider) widen regions until the loss is within this share of max_loss: a wide
# region stays integer on the engine, so it buys accuracy more cheaply than a float one. Measured (Q/DQ reference
# semantics, 64 calibration / 200 held-out lines, FP32 100%): academic_int4 classifier at max_loss 0.02 -> 40 of 53
# regions int8 (W8A8), 90.0% (as the 36 floats of the budget alone); 0.005 -> 50 wide, 99.5%; 0.002 -> 52, 100%
WIDER_SHARE = 0.25


class Reason:
    """Why a region got its decision (the strings in placement files and reports)."""

    FASTER = "faster in int8"
    SLOWER = "slower in int8"
    BUDGET = "accuracy budget"
    FILE = "placement file"
    FORCED = "onnxruntime quantizes it anyway when float (Q/DQ both sides)"
    KEPT = "kept int8: the model stays faster than FP32"
    WHOLE_MODEL = "int8: the all-INT8 model is no slower than the source (per-region times not profiled)"
    ALL_FLOAT = "float: the placed mixed file timed slower than the source, all float is faster"
    NOT_TIMED = "int8 within the accuracy budget (speed not measured for this engine)"
    WIDER = "accuracy budget: the platform's wider format"
    DYNAMIC = "dynamic activation quantization timed faster"
    ALL_DYNAMIC = "dynamic: the file with every MatMul region dynamic timed fastest"
    WIDER_NOT_ENOUGH = "accuracy budget: float (every region in the wider format is not enough)"


# decisions of a region (RegionDecision.decision); DYNAMIC: int8 weights, the activation quantized at run time
# (export.dynamic: DynamicQuantizeLinear + MatMulInteger, onnxruntime's DynamicQuantizeMatMul)
INT8, WIDER, FLOAT, DYNAMIC = "int8", "wider", "float", "dynamic"
# the wide-format graph of a model (the same model calibrated with Platform.widened()), built when first needed
WideFactory = Callable[[], QuantizedGraph]


@dataclass
class RegionDecision:
    """One region's decision with what it was based on (times in ms per batch-1 run, losses as in sensitivity)."""

    anchor: str
    op_type: str
    ops: list[str]
    decision: str  # INT8 ("int8": the platform's own format) | WIDER ("wider": Platform.wider) | FLOAT ("float")
    reason: str
    int8_ms: float | None = None
    fp32_ms: float | None = None
    loss_only: float | None = None
    loss_all_but: float | None = None
    gain: float | None = None
    wider_format: str | None = None  # the wider format's label where decision is WIDER
    wider_gain: float | None = None  # loss(all in the platform's format) - loss(only this region wide)
    dynamic_ms: float | None = None  # the region's time with its activation quantized at run time (DYNAMIC step)

    def describe(self) -> str:
        """How the region runs: 'int8', 'float', or the wider format's label."""
        return f"{self.decision}: {self.wider_format}" if self.decision == WIDER and self.wider_format else self.decision

    def row(self, wider: bool = False) -> list[str]:
        def f(x: float | None, fmt: str) -> str:
            return "-" if x is None else format(x, fmt)

        return [self.anchor, self.op_type, self.describe(), self.reason, f(self.fp32_ms, ".3f"), f(self.int8_ms, ".3f"),
                f(self.loss_only, ".2e"), f(self.gain, ".2e")] + ([f(self.wider_gain, ".2e")] if wider else [])

    def as_dict(self) -> dict[str, Any]:
        """The fields, the wider-format ones only where set (files of platforms without one stay as they were)."""
        d = asdict(self)
        for k in WIDER_FIELDS:
            if d[k] is None:
                del d[k]
        return d


WIDER_FIELDS = ("wider_format", "wider_gain", "dynamic_ms")
DECISIONS = (INT8, WIDER, FLOAT, DYNAMIC)

_OPT_NUMBER, _STR, _OPT_STR = (int, float, type(None)), (str,), (str, type(None))
_JSON_NAMES = {int: "number", float: "number", str: "string", dict: "object", list: "list", type(None): "null"}
# the JSON types of each field of a placement file (required fields first: (types, required))
_PLACEMENT_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "model_sha256": (_STR, True), "platform": (_STR, True), "target": (_STR, True), "host": ((dict,), True),
    "objective": (_STR, True), "max_loss": (_OPT_NUMBER, True), "loss_metric": (_STR, True),
    "regions": ((list,), True), "measured": ((dict,), False), "note": (_STR, False), "format": (_STR, True)}
_REGION_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "anchor": (_STR, True), "op_type": (_STR, True), "ops": ((list,), True), "decision": (_STR, True),
    "reason": (_STR, True), "int8_ms": (_OPT_NUMBER, False), "fp32_ms": (_OPT_NUMBER, False),
    "loss_only": (_OPT_NUMBER, False), "loss_all_but": (_OPT_NUMBER, False), "gain": (_OPT_NUMBER, False),
    "wider_format": (_OPT_STR, False), "wider_gain": (_OPT_NUMBER, False), "dynamic_ms": (_OPT_NUMBER, False)}


def _check_fields(data: dict[str, Any], spec: dict[str, tuple[tuple[type, ...], bool]], where: str) -> None:
    """ConfigError naming `where` and the field when a required field is missing or a field has the wrong JSON type
    (a bool is no number)."""
    missing = [k for k, (_, required) in spec.items() if required and k not in data]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(missing)}; write the file again with --placement "
                          "(QuantizedModel.save_placement)")
    for key, value in data.items():
        if key not in spec:
            continue  # unknown fields: reported by the dataclass below
        types = spec[key][0]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            names = " or ".join(dict.fromkeys(_JSON_NAMES[t] for t in types))
            raise ConfigError(f"{where}: field '{key}' must be a {names}, got {json.dumps(value)[:60]}; fix the file or "
                              "write it again with --placement")
ROW_HEADER = ["region (anchor op)", "type", "runs in", "why", "FP32 ms", "INT8 ms", "loss if only it is int8",
              "loss saved if float"]
WIDER_HEADER = "loss saved if only it is wider"


@dataclass
class Placement:
    """Per-region INT8 / float decisions for one model, platform and host, with their measurements."""

    model_sha256: str
    platform: str
    target: str
    host: dict[str, str]
    objective: str
    max_loss: float | None
    loss_metric: str
    regions: list[RegionDecision] = field(default_factory=list)
    measured: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    format: str = FORMAT

    def float_anchors(self) -> list[str]:
        return [r.anchor for r in self.regions if r.decision == FLOAT]

    def dynamic_anchors(self) -> list[str]:
        """The regions whose activation input is quantized at run time (DYNAMIC)."""
        return [r.anchor for r in self.regions if r.decision == DYNAMIC]

    def wider_anchors(self) -> list[str]:
        """The regions that run in the platform's wider format (Platform.wider)."""
        return [r.anchor for r in self.regions if r.decision == WIDER]

    def to_json(self) -> str:
        data = asdict(self)
        data["regions"] = [r.as_dict() for r in self.regions]
        return json.dumps(data, indent=1, sort_keys=False) + "\n"

    def save(self, path: str | os.PathLike[str]) -> Path:
        write_text_atomic(path, self.to_json(), what="placement file")
        return Path(path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Placement:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise ConfigError(f"cannot read placement file '{path}': {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ConfigError(f"'{path}' is not a netquant placement file (format '{FORMAT}' expected)")
        _check_fields(data, _PLACEMENT_FIELDS, f"placement file '{path}'")
        if data["max_loss"] is not None and not math.isfinite(data["max_loss"]):
            raise ConfigError(f"placement file '{path}': max_loss {data['max_loss']} is not a finite number; fix the "
                              "file or write it again with --placement")
        if not isinstance(data["regions"], list):
            raise ConfigError(f"placement file '{path}': 'regions' must be a list of region decisions, got "
                              f"{type(data['regions']).__name__}; write the file again with --placement")
        for i, r in enumerate(data["regions"]):
            where = f"placement file '{path}', region {i}"
            if not isinstance(r, dict):
                raise ConfigError(f"{where}: a region decision must be a JSON object, got {type(r).__name__}")
            _check_fields(r, _REGION_FIELDS, where)
            if r["decision"] not in DECISIONS:
                raise ConfigError(f"{where} ('{r['anchor']}'): decision {r['decision']!r} is not one of "
                                  f"{', '.join(DECISIONS)} (lower case); fix the file or measure again")
        try:
            regions = [RegionDecision(**r) for r in data.pop("regions")]
            return cls(regions=regions, **data)
        except TypeError as exc:
            raise ConfigError(f"placement file '{path}' has unexpected fields: {exc}") from exc

    def summary(self) -> dict[str, Any]:
        """The decisions and totals for QuantizedModel.summary()."""
        return {"objective": self.objective, "max_loss": self.max_loss, "loss_metric": self.loss_metric,
                "host": dict(self.host), "measured": dict(self.measured), "note": self.note,
                "int8_regions": sum(r.decision == INT8 for r in self.regions),
                "dynamic_regions": sum(r.decision == DYNAMIC for r in self.regions),
                "wider_regions": sum(r.decision == WIDER for r in self.regions),
                "float_regions": sum(r.decision == FLOAT for r in self.regions),
                "regions": [r.as_dict() for r in self.regions]}

    def markdown(self) -> str:
        """The decision table of the report (--report x.md)."""
        lines = [f"Placement ({self.objective}, max_loss {self.max_loss}, {self.loss_metric}) on {self.host.get('cpu', '?')}"
                 f" ({self.host.get('kernel_family', '?')}): " + ", ".join(f"{k} {v}" for k, v in self.measured.items()),
                 ""]
        if self.note:
            lines += [self.note, ""]
        if "placed_ms" not in self.measured and "loss_placed" not in self.measured and self.note:
            return "\n".join(lines)  # not measured: no decision table to show
        wider = any(r.wider_gain is not None or r.decision == WIDER for r in self.regions)
        header = ROW_HEADER + ([WIDER_HEADER] if wider else [])
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        lines += ["| " + " | ".join(r.row(wider)) + " |" for r in self.regions]
        return "\n".join(lines) + "\n"


def model_hash(qgraph: QuantizedGraph) -> str:
    """sha256 of the cleaned-up FP32 graph as ONNX (what placement decisions refer to): each initializer's header and
    raw bytes in order, then the model without initializers."""
    from netquant.export.onnx_qdq import fp32_onnx
    from netquant.export.opset import without_initializers

    model = fp32_onnx(qgraph)
    digest = hashlib.sha256()
    for t in model.graph.initializer:  # tensor by tensor, from the graph's own tensors where it has them (no copy)
        digest.update(onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type).SerializeToString())
        own = qgraph.graph.initializers.get(t.name)
        if isinstance(own, torch.Tensor) and own.dtype == torch.float32 and tuple(own.shape) == tuple(t.dims):
            digest.update(own.detach().contiguous().numpy().data)
        else:
            digest.update(t.raw_data if t.raw_data else t.SerializeToString(deterministic=True))
    digest.update(without_initializers(model).SerializeToString(deterministic=True))  # everything else
    return digest.hexdigest()


def _host() -> dict[str, str]:
    import onnxruntime as ort

    from netquant.platforms.targets import host_info, kernel_family

    info = host_info(ort_threads=1)
    return {"cpu": info.cpu.describe(), "kernel_family": f"{info.accumulation.value}: "
            f"{kernel_family(info.accumulation, info.cpu)}", "onnxruntime": ort.__version__}


# symbolic names of a leading axis that holds samples (a batch): only such an axis is cut to the samples placement times
_BATCH_AXIS = re.compile(r"^(n|b|bs|nb|batch|batches|batch_?size|n_?batch|num_?batch(es)?|unk__\d+|\w*_dynamic_axes_1)$",
                         re.IGNORECASE)


def batch_axis(v: Any) -> bool:
    """Whether input `v`'s dim 0 is a batch axis placement may cut: a symbolic dim named like a batch ('batch',
    'N', 'batch_size', onnx's 'unk__<n>', torch's unnamed '<input>_dynamic_axes_1'), or unknown. A fixed dim, or a
    symbolic one with another name ('frames', 'seq', 'time'), keeps the calibration batch's shape: a streaming
    model's [frames, samples] input is timed with the frames it is fed."""
    if v.shape is None:
        return True  # nothing declared: as a batch (the rule before batch_axis)
    if len(v.shape) == 0:
        return False
    dim = v.shape[0]
    return dim is None or (isinstance(dim, str) and (dim == "" or bool(_BATCH_AXIS.match(dim))))


def _first(batch: dict[str, torch.Tensor], qgraph: QuantizedGraph, n: int) -> dict[str, torch.Tensor]:
    """The first n samples of a calibration batch along the inputs' batch axis (batch_axis); inputs without one
    (a fixed or non-batch dim 0) are taken whole, at the calibration batch's shape."""
    out = {}
    for v in qgraph.graph.inputs:
        if v.name in batch:
            x = batch[v.name]
            out[v.name] = x[:n] if batch_axis(v) and x.dim() > 0 else x
    return out


def _batch1(batch: dict[str, torch.Tensor], qgraph: QuantizedGraph) -> dict[str, np.ndarray]:
    """One sample of a calibration batch, as numpy feeds for onnxruntime."""
    return {k: v.detach().cpu().numpy() for k, v in _first(batch, qgraph, 1).items()}


def applies(settings: QuantSettings, qgraph: QuantizedGraph) -> bool:
    """True when a placement file or an objective is set: onnxruntime CPU platforms are timed and budgeted, every
    other platform (its engine is not timed here) gets the accuracy budget alone."""
    return settings.placement_from is not None or settings.objective is not None


def timed(qgraph: QuantizedGraph) -> bool:
    """Whether placement measures speed for this platform (onnxruntime CPU, the engine profiled here)."""
    return qgraph.platform.validation is Validation.ONNXRUNTIME


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


def _wide_graph(qgraph: QuantizedGraph, wide: WideFactory | None, what: str) -> QuantizedGraph:
    """The wide-format twin of `qgraph` from `wide` (ConfigError naming `what` when there is none)."""
    if wide is None or qgraph.platform.wider is None:
        raise ConfigError(f"{what} runs regions in the wider format, but platform '{qgraph.platform.name}' has none "
                          "here (Platform.wider; the calibration data must be a list, not a one-shot stream)")
    twin = wide()
    check_twin(qgraph, twin)
    return twin


def apply_placement_file(qgraph: QuantizedGraph, path: str | os.PathLike[str],
                         wide: WideFactory | None = None) -> Placement:
    """Keep in float (run in the wider format) the regions a placement file says, after checking it was made for this
    model and platform."""
    placement = Placement.load(path)
    digest = model_hash(qgraph)
    if placement.model_sha256 != digest:
        raise ConfigError(f"placement file '{path}' was made for another model (sha256 {placement.model_sha256[:12]}"
                          f"..., this model after clean-up: {digest[:12]}...); measure again (drop placement_from / "
                          "--placement-from) or use the same model and clean-up settings")
    if placement.platform != qgraph.platform.name:
        raise ConfigError(f"placement file '{path}' is for platform '{placement.platform}', not "
                          f"'{qgraph.platform.name}'")
    target = str(qgraph.platform.cpu_target)
    if placement.target != target:
        raise ConfigError(f"placement file '{path}' was measured for CPU target '{placement.target}', this run's target "
                          f"is '{target}' (--target): int8 speed and weights differ between targets; give --target "
                          f"{placement.target} or measure again (drop --placement-from)")
    regions = {r.anchor: r for r in find_regions(qgraph)}
    missing = [a for a in placement.float_anchors() + placement.wider_anchors() + placement.dynamic_anchors()
               if a not in regions]
    if missing:
        raise ConfigError(f"placement file '{path}' keeps region(s) {', '.join(missing[:5])} in float or the wider "
                          "format, but this quantized graph has no such region (other quantization settings?); measure "
                          "again")
    if placement.wider_anchors():
        twin = _wide_graph(qgraph, wide, f"placement file '{path}'")
        widen(qgraph, twin, [regions[a] for a in placement.wider_anchors()])
    keep_float(qgraph, [regions[a] for a in placement.float_anchors()])
    qgraph.dynamic_ops = set(placement.dynamic_anchors())
    qgraph.attention_rewrite = rewrite_from_dict(placement.measured.get("attention"), f"placement file '{path}'")
    placement.note = (placement.note + " " if placement.note else "") + f"re-applied from {Path(path).name}"
    return placement


def _clear_verdict(ms: list[float]) -> bool:
    """The whole-model check's medians [FP32, INT8] so far leave no doubt (WALL_CLEAR either way)."""
    fp32, int8 = ms
    return int8 <= (1 - WALL_CLEAR) * fp32 or int8 >= (1 + WALL_CLEAR) * fp32


class _Search:
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
        self.feeds: dict[str, np.ndarray] | None = _batch1(batch, qgraph) if batch is not None else None
        self.t8: dict[str, float] = {}
        self.t32: dict[str, float] = {}
        self.forced: set[str] = set()
        self.profiles = 0
        self.profile_s = 0.0
        self.built: dict[frozenset[str], onnx.ModelProto] = {}

    def build(self, float_set: set[str]) -> onnx.ModelProto:
        """The QDQ export of the quantized graph with `float_set` kept in float (memoised)."""
        from netquant.export.onnx_qdq import build_qdq_model

        key = frozenset(float_set)
        if key not in self.built:
            with keep_float(self.qgraph, [self.by_anchor[a] for a in sorted(float_set)]):
                self.built[key] = build_qdq_model(self.qgraph, share=True)[0]
        return self.built[key]

    def wall_clock(self, models: list[onnx.ModelProto], settled: Callable[[list[float]], bool] | None = None
                   ) -> list[float]:
        """Wall-clock ms of each model against the others (analysis.profile.wall_clock_ms within WALL_BUDGET_S), its
        time counted in profile_s."""
        t = time.perf_counter()
        try:
            return wall_clock_ms(models, self.feeds or {}, rounds=WALL_ROUNDS, runs=WALL_RUNS, budget_s=WALL_BUDGET_S,
                                 settled=settled)
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


class _Budget:
    """The accuracy budget of one search: the fake-quant loss of a float set (memoised; 0 without a budget) and the
    greedy choice of regions to float until it is within max_loss."""

    def __init__(self, s: _Search, max_loss: float | None, objective: Objective,
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
            qgraph, settings = s.qgraph, s.settings
            data = (list(settings.eval_data) if settings.eval_data is not None
                    else [_first(b, qgraph, SENSITIVITY_SAMPLES) for b in (qgraph.validation_batches[:1]
                                                                           or [qgraph.sample_inputs])])
            self.meter = LossMeter(qgraph, data, settings.metric)

    def loss(self, fl: set[str] | frozenset[str]) -> float:
        key = frozenset(fl)
        if self.meter is None:
            return 0.0
        if key not in self.loss_of:
            self.loss_of[key] = self.meter.loss([self.s.by_anchor[a] for a in sorted(fl)])
        return self.loss_of[key]

    def wide_loss(self, wide: set[str] | frozenset[str], fl: set[str] | frozenset[str] = frozenset()) -> float:
        """The loss with the regions `wide` in the wider format and `fl` in float (memoised)."""
        if not wide:
            return self.loss(fl)
        key = (frozenset(wide), frozenset(fl))
        if self.meter is None:
            return 0.0
        if key not in self.wide_loss_of:
            if self.wide is None:
                self.wide = _wide_graph(self.s.qgraph, self.wide_factory, "the accuracy budget")
            with widen(self.s.qgraph, self.wide, [self.s.by_anchor[a] for a in sorted(wide)]):
                self.wide_loss_of[key] = self.loss_of_meter(fl)
        return self.wide_loss_of[key]

    def loss_of_meter(self, fl: set[str] | frozenset[str]) -> float:
        assert self.meter is not None
        return self.meter.loss([self.s.by_anchor[a] for a in sorted(fl)])

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

    def score(self, a: str) -> tuple[float, str]:
        """Greedy order: the loss floating `a` saves on top of the fixed floats, or where those were not all measured
        within the cap, its output's noise-to-signal ratio; per ms it costs for BALANCED where times were measured."""
        complete = all(se.gain is not None for se in self.marginal.values())
        se = self.marginal.get(a)
        gain = (se.gain or 0.0) if complete and se is not None else self.local.get(a, 0.0)
        if self.objective is Objective.ACCURACY or not self.s.t32:
            return gain, a
        return gain / max(self.saved_ms(a), 1e-3), a

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
        """Measure what floating each of `left` saves on top of `fixed` (once, when the budget first needs it)."""
        if self.marginal or self.meter is None:
            return
        s = self.s
        self.local.update(region_output_nsr(self.meter, s.regions))
        order = sorted((s.by_anchor[a] for a in left), key=lambda r: (-self.saved_ms(r.anchor), r.anchor))
        self.marginal.update(region_sensitivity(self.meter, order, [s.by_anchor[a] for a in sorted(fixed)],
                                                deadline=s.deadline, only=False)[1])

    def report(self, best: frozenset[str], deadline: float) -> dict[str, Sensitivity]:
        """Each region's sensitivity (vs all INT8) for the report, placed regions first, until `deadline`."""
        sens: dict[str, Sensitivity] = {}
        if self.meter is None:
            return sens
        everything = set(self.s.by_anchor)
        for r in sorted(self.s.regions, key=lambda r: (r.anchor not in best, r.anchor)):
            if time.perf_counter() > deadline:
                break
            all_but = self.loss({r.anchor})
            only = self.loss(everything - {r.anchor}) if time.perf_counter() <= deadline else None
            sens[r.anchor] = Sensitivity(only, all_but, self.loss(set()) - all_but)
        return sens


def _decisions(s: _Search, best: frozenset[str], sens: dict[str, Sensitivity],
               reason_of: Any, wide: frozenset[str] = frozenset(), wider_gain: dict[str, float] | None = None
               ) -> list[RegionDecision]:
    """One RegionDecision per region: float where in `best`, the wider format where in `wide`, with reason_of(anchor)
    and its times / losses."""
    out = []
    label = s.qgraph.platform.wider.label if s.qgraph.platform.wider is not None else None
    for r in s.regions:
        a, se = r.anchor, sens.get(r.anchor)
        t8, t32 = s.t8.get(a), s.t32.get(a)
        decision = FLOAT if a in best else WIDER if a in wide else INT8
        g = (wider_gain or {}).get(a)
        out.append(RegionDecision(a, r.op_type, list(r.ops), decision, reason_of(a),
                                  None if t8 is None else round(t8, 4), None if t32 is None else round(t32, 4),
                                  se.only if se else None, se.all_but if se else None, se.gain if se else None,
                                  label if decision == WIDER else None, None if g is None else float(f"{g:.6g}")))
    return out


def _budget_only(s: _Search, budget: _Budget, placement: Placement, start: float, time_budget_s: float) -> Placement:
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

    placement.regions = _decisions(s, best, sens, reason_of, wide, gains)
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


def _all_int8_unprofiled(s: _Search, budget: _Budget, placement: Placement, measured: dict[str, Any], start: float,
                         time_budget_s: float) -> Placement:
    """BALANCED / ACCURACY decided by the whole-model check (all INT8 no slower than the source, within the budget)
    when the cap leaves no time for per-region profiles: every region INT8, times not profiled."""
    sens = budget.report(frozenset(), min(s.deadline, time.perf_counter() + REPORT_SHARE * time_budget_s))
    placement.regions = _decisions(s, frozenset(), sens, lambda a: Reason.WHOLE_MODEL)
    measured.update({"speedup_vs_fp32": measured["source_fp32_wall_ms"] / max(measured["all_int8_wall_ms"], 1e-9),
                     "loss_all_int8": budget.loss_of.get(frozenset()), "loss_placed": budget.loss_of.get(frozenset()),
                     "profiles": 0, "profile_s": s.profile_s, "loss_passes": budget.meter.calls if budget.meter else 0,
                     "seconds": time.perf_counter() - start})
    placement.measured = {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in measured.items()}
    placement.note = "; ".join(filter(None, [placement.note, "all INT8: no slower than the source model and within "
                                             "the budget; per-region times not profiled (time cap)"]))
    return placement


def search_placement(qgraph: QuantizedGraph, settings: QuantSettings, time_budget_s: float = 30.0,
                     source: onnx.ModelProto | None = None, wide: WideFactory | None = None,
                     search_s: float | None = None) -> Placement:
    """Measure and decide (module docstring); applies the decision to `qgraph` (keep_float) and returns it.
    Platforms other than onnxruntime CPU: the accuracy budget alone (_budget_only).
    search_s: the cap (default time_budget_s) where the whole-model check does not decide (INT8 slower than the
    source, over the budget, or LATENCY): the per-region profiles and rounds then make the decision itself."""
    start = time.perf_counter()
    objective = Objective.parse(settings.objective) if settings.objective is not None else Objective.BALANCED
    max_loss = settings.max_loss if settings.max_loss is not None else DEFAULT_MAX_LOSS[objective]
    metric_name = "user metric drop" if settings.metric is not None else "1 - output cosine"
    placement = Placement(model_hash(qgraph), qgraph.platform.name, str(getattr(qgraph.platform, "cpu_target", "")),
                          _host(), objective.value, max_loss, metric_name)
    s = _Search(qgraph, settings, start + time_budget_s)
    if not s.regions or s.feeds is None:
        placement.note = "not measured: no quantized region" if not s.regions else "not measured: no calibration batch kept"
        placement.regions = [RegionDecision(r.anchor, r.op_type, list(r.ops), "int8", "rules (not measured)")
                             for r in s.regions]
        return placement
    if not timed(qgraph):
        return _budget_only(s, _Budget(s, max_loss, objective, wide), placement, start, time_budget_s)
    weights = sum(int(qgraph.graph.initializers[i].numel()) for r in s.regions for op in r.ops
                  for i in qgraph.graph.node(op).inputs if i in qgraph.graph.initializers)
    if weights < MIN_WEIGHTS:
        placement.note = (f"not measured: {weights} weights in all regions (< {MIN_WEIGHTS}), too small for per-op "
                          "timing; the platform's rules decide")
        placement.regions = [RegionDecision(r.anchor, r.op_type, list(r.ops), "int8", "rules (model too small)")
                             for r in s.regions]
        return placement

    all_anchors = set(s.by_anchor)
    measured: dict[str, Any] = {"timed_shapes": {k: list(v.shape) for k, v in (s.feeds or {}).items()}}
    budget = _Budget(s, max_loss, objective)
    # INT8 first (BALANCED, ACCURACY): the all-INT8 file is kept whole when it is no slower than the user's FP32
    # model, timed interleaved without the profiler (whose per-node overhead weighs on the Q/DQ-rich INT8 graph)
    int8_first_ok = False
    if source is not None and objective is not Objective.LATENCY:
        try:
            src_ms, all8_ms = s.wall_clock([source, s.build(set())], settled=_clear_verdict)
        except ExportError as exc:  # the source does not run in onnxruntime: compare with the cleaned FP32 graph
            placement.note = f"source model not timed ({str(exc).splitlines()[0][:200]}); FP32 = the cleaned graph"
        else:
            measured.update({"source_fp32_wall_ms": src_ms, "all_int8_wall_ms": all8_ms})
            int8_first_ok = all8_ms <= src_ms
    if int8_first_ok and (max_loss is None or budget.loss(set()) <= max_loss) and \
            time.perf_counter() > start + PROFILE_AFTER_SHARE * time_budget_s:
        # decided (all INT8, within the budget); the per-region profiles would only inform the report: not within
        # the cap
        placement = _all_int8_unprofiled(s, budget, placement, measured, start, time_budget_s)
        return _choose_dynamic_and_attention(s, placement, source, max_loss, search_s or time_budget_s)
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

    float_speed = s.settle(speed_floats(s.slower(), p8.node_total_ms))

    budget_float = budget.fill(float_speed, s.forced)
    for _ in range(len(all_anchors)):  # a budget float onnxruntime would re-quantize is no float: choose again
        settled = s.settle(float_speed | budget_float)
        if settled == float_speed | budget_float:
            break
        budget_float = (settled - float_speed) | budget.fill(settled, s.forced)
    # iterate on the candidate
    current = float_speed | budget_float
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
        budget_float = (budget_float - s.forced) | budget.fill(speed | (budget_float - s.forced), s.forced)
        current = s.settle(speed | budget_float)
        budget_float &= current
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
        # add to: the decision, timed like the INT8-first check against the source and the all-float file, must be
        # no slower than the source, else the faster of it and all float ships
        assert source is not None  # it was timed
        src_ms, placed_ms, float_ms = s.wall_clock([source, s.build(set(best)), s.build(all_anchors)])
        measured.update({"source_fp32_wall_ms": src_ms, "placed_wall_ms": placed_ms, "all_float_wall_ms": float_ms})
        if placed_ms > src_ms and float_ms < placed_ms:
            placed_float, best, best_t = best, frozenset(all_anchors), p32.node_total_ms
            placement.note = "; ".join(filter(None, [placement.note, "the placed file timed slower than the source: "
                                                     "every region float (INT8 does not pay off on this CPU)"]))
    final_loss = budget.loss(best) if budget.meter is not None else None
    sens = budget.report(best, min(s.deadline, time.perf_counter() + REPORT_SHARE * time_budget_s))
    keep_float(qgraph, [s.by_anchor[a] for a in sorted(best)])
    slower = s.slower()

    def reason_of(a: str) -> str:
        if a in best and a not in placed_float:
            return Reason.ALL_FLOAT
        if a in best:
            return Reason.BUDGET if a in budget_float else Reason.SLOWER
        if a in s.forced:
            return Reason.FORCED
        if a not in slower:
            return Reason.FASTER
        return "fastest measured candidate" if objective is Objective.LATENCY else Reason.KEPT

    placement.regions = _decisions(s, best, sens, reason_of)
    measured.update({"placed_ms": best_t, "speedup_vs_fp32": p32.node_total_ms / best_t if best_t else 0.0,
                     "other_fp32_ms": region_times(p32, s.nmap, s.region_of, set()).get(OTHER, 0.0),
                     "loss_all_int8": budget.loss_of.get(frozenset()), "loss_placed": final_loss,
                     "profiles": s.profiles, "profile_s": s.profile_s,
                     "loss_passes": budget.meter.calls if budget.meter else 0,
                     "rounds": rounds, "seconds": time.perf_counter() - start})
    if int8_first_ok and not best:  # the shipped file is the all-INT8 one timed against the source: that ratio
        measured["speedup_vs_fp32"] = measured["source_fp32_wall_ms"] / max(measured["all_int8_wall_ms"], 1e-9)
    placement.measured = {k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in measured.items()}
    if time.perf_counter() > s.deadline:  # the cap in force (search_s may have raised it) and the time really taken
        cap, took = s.deadline - start, time.perf_counter() - start
        placement.note = "; ".join(filter(None, [placement.note, f"time cap {cap:.2f} s reached after {took:.2f} s "
                                                 "(the whole-model timings and the FP32 and all-INT8 profiles always "
                                                 "run): some measurements skipped"]))
    return _choose_dynamic_and_attention(s, placement, source, max_loss, search_s or time_budget_s)


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


def _choose_dynamic_and_attention(s: _Search, placement: Placement, source: onnx.ModelProto | None,
                                  max_loss: float | None, cap_s: float) -> Placement:
    """_choose_dynamic, then the transformer ops by measurement (analysis.attention; recorded as
    measured['attention'])."""
    placement = _choose_dynamic(s, placement, source, max_loss, cap_s)
    attention = place_attention(s.qgraph, s.feeds, source, cap_s)
    if attention is not None:
        placement.measured["attention"] = attention.as_dict()
    return placement


def _choose_dynamic(s: _Search, placement: Placement, source: onnx.ModelProto | None, max_loss: float | None,
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
