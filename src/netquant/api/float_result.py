"""No silent float files: how much of a quantized model runs in INT8, why the rest stays float, and the refusal of a
result that is (nearly) all float unless the user asked for it.

A region (analysis.regions) counts as INT8 when it runs in the platform's format or its wider integer format
(placement decisions 'int8' / 'wider'); without a placement every region the rules quantized does. A result is float
when no region is INT8, or, with min_int8_fraction, when the INT8 share is below it; exporting it as a model file
(QuantizedModel.export / write, the CLI) then raises FloatResultError with the measured trade-off, unless
allow_float=True or objective='latency' (whose purpose is the fastest file, float or not).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from netquant.analysis.regions import find_regions
from netquant.errors import FloatResultError
from netquant.passes.quant_graph import QuantizedGraph

if TYPE_CHECKING:
    from netquant.analysis.placement import Placement

# placement reasons (analysis.placement.Reason) in the words of the summary
_REASON_WORDS = {
    "slower in int8": "slower in int8 here",
    "accuracy budget": "over the accuracy budget",
    "accuracy budget: float (every region in the wider format is not enough)": "over the accuracy budget",
    "float: the placed mixed file timed slower than the source, all float is faster":
        "the mixed file timed slower than FP32 here, so all float",
    "placement file": "the placement file says so",
}


@dataclass(frozen=True)
class Int8Share:
    """Regions in INT8 (or the platform's wider integer format) out of all quantizable regions."""

    int8: int
    total: int

    @property
    def fraction(self) -> float:
        return self.int8 / self.total if self.total else 0.0

    def is_float(self, min_fraction: float | None) -> bool:
        """No INT8 region (min_fraction None), or an INT8 share below min_fraction."""
        return self.int8 == 0 if min_fraction is None else self.fraction < min_fraction


@dataclass(frozen=True)
class FloatPolicy:
    """What the user accepts: a float result (allow_float, or objective 'latency'), and the INT8 share required
    (min_fraction None: at least one region)."""

    allow_float: bool = False
    min_fraction: float | None = None


@dataclass(frozen=True)
class FloatGroup:
    """Regions that stay float for one reason, by kind of anchor op ('depthwise Conv', 'Conv', 'MatMul', ...)."""

    reason: str
    kind: str
    regions: int


def int8_share(qgraph: QuantizedGraph, placement: Placement | None) -> Int8Share:
    if placement is not None and placement.regions:
        return Int8Share(sum(r.decision != "float" for r in placement.regions), len(placement.regions))
    n = len(find_regions(qgraph))
    return Int8Share(n, n)


def region_kind(qgraph: QuantizedGraph, anchor: str, op_type: str) -> str:
    """'depthwise Conv' (group == output channels, one input channel per group), 'grouped Conv', else the op type."""
    if op_type != "Conv":
        return op_type
    node = next((n for n in qgraph.graph.nodes if n.name == anchor), None)
    if node is None:
        return op_type
    group = int(node.attrs.get("group", 1) or 1)
    if group <= 1:
        return op_type
    w = qgraph.graph.initializers.get(node.inputs[1]) if len(node.inputs) > 1 else None
    if w is not None and w.dim() >= 2 and int(w.shape[1]) == 1 and int(w.shape[0]) == group:
        return "depthwise Conv"
    return "grouped Conv"


def float_groups(qgraph: QuantizedGraph, placement: Placement | None) -> list[FloatGroup]:
    """Why regions stay float, grouped by reason and kind of op, most regions first."""
    if placement is None:
        return []
    counts: Counter[tuple[str, str]] = Counter()
    for r in placement.regions:
        if r.decision == "float":
            counts[(_REASON_WORDS.get(r.reason, r.reason), region_kind(qgraph, r.anchor, r.op_type))] += 1
    return [FloatGroup(reason, kind, n) for (reason, kind), n in
            sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def float_words(groups: list[FloatGroup]) -> str:
    """'slower in int8 here: 17 depthwise Conv, 5 Conv; over the accuracy budget: 9 Conv' ('' when none)."""
    by_reason: dict[str, list[str]] = {}
    for g in groups:
        by_reason.setdefault(g.reason, []).append(f"{g.regions} {g.kind}")
    return "; ".join(f"{reason}: {', '.join(kinds)}" for reason, kinds in by_reason.items())


def _pair(m: dict[str, Any], t_key: str, ref_key: str) -> tuple[float, float] | None:
    t, ref = m.get(t_key), m.get(ref_key)
    if isinstance(t, (int, float)) and isinstance(ref, (int, float)) and t > 0:
        return float(t), float(ref)
    return None


def tradeoff_lines(placement: Placement | None) -> list[str]:
    """The measured trade-off: all INT8 (loss, time), the placed file, all float (time), from placement.measured.
    Each time is compared with the FP32 model measured the same way: wall clock against the source model (batch 1,
    one thread) where placement timed it so, else per-node profiles against the profiled FP32 graph."""
    if placement is None:
        return ["not measured (objective None: the platform's rules alone decided)"]
    m = placement.measured

    def speed(wall: str, profiled: str) -> str:
        for key, ref, how in ((wall, "source_fp32_wall_ms", "wall clock"), (profiled, "fp32_ms", "profiled")):
            p = _pair(m, key, ref)
            if p is not None:
                return f"{p[0]:.3f} ms vs FP32 {p[1]:.3f} ms ({how}): {p[1] / p[0]:.2f}x the FP32 speed"
        return "time not measured"

    def loss(x: Any) -> str:
        return f"loss {x:.4g} (1 - output cosine)" if isinstance(x, (int, float)) else "loss not measured"

    return [f"all INT8: {loss(m.get('loss_all_int8'))}, {speed('all_int8_wall_ms', 'all_int8_ms')}",
            f"placed (this result): {loss(m.get('loss_placed'))}, {speed('placed_wall_ms', 'placed_ms')}",
            f"all float: {speed('all_float_wall_ms', 'fp32_ms')}",
            f"(batch 1, one thread, onnxruntime here; max_loss {placement.max_loss})"]


def check_float_result(qgraph: QuantizedGraph, placement: Placement | None, policy: FloatPolicy, where: str
                       ) -> Int8Share:
    """FloatResultError naming `where` when the result is float (Int8Share.is_float) and the policy does not allow
    it; else the share."""
    share = int8_share(qgraph, placement)
    min_fraction = policy.min_fraction
    if not share.is_float(min_fraction) or policy.allow_float:
        return share
    why = float_words(float_groups(qgraph, placement))
    what = (f"{share.int8} of {share.total} regions run in INT8" if share.total else
            f"no op of the model is quantized for platform '{qgraph.platform.name}' (nothing it quantizes)")
    floor = f" (minimum share {min_fraction:g})" if min_fraction is not None else ""
    lines = "\n  ".join(tradeoff_lines(placement) if share.total else [])
    raise FloatResultError(
        f"{where}: {what}{floor}: the file would be the float model under an INT8 name. "
        + (f"Float because {why}. " if why else "")
        + (f"Measured here:\n  {lines}\n" if lines else "")
        + "Options: allow_float=True / --allow-float to write it anyway; objective='latency' / --objective latency "
          "for the fastest file, float or not; --max-loss higher or --objective none to keep regions in INT8 (the "
          "all-INT8 loss above); min_int8_fraction / --min-int8-fraction to set the share required. No file written.")
