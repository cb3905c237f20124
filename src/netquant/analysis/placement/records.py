"""Placement records: a region's decision and why (RegionDecision, Reason) and the placement file (Placement)."""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from netquant.analysis.placement.constants import EDGE_MIN_GAIN, FORMAT, TABLE_MIN_GAIN, WEIGHT_ONLY_SHARE
from netquant.atomic import write_text_atomic
from netquant.errors import ConfigError


def significant(x: float, digits: int = 6) -> float:
    """x rounded to `digits` significant digits, as placement files and `measured` record losses and times."""
    return float(f"{x:.{digits}g}")


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
    EDGE = ("float: the first / last projection or a small embedding table, a small share of the weights, floating "
            f"it saves at least {EDGE_MIN_GAIN:.0%} of the all-INT8 loss ({TABLE_MIN_GAIN:.0%} for a table under the "
            "balanced objective; measured['edge_floats'])")
    EDGE_WEIGHT_ONLY = ("weight-only: the first / last projection, its activations float and its weights int8 keep "
                        f"at least {WEIGHT_ONLY_SHARE:.0%} of what floating it saves (measured['edge_floats'])")


# decisions of a region (RegionDecision.decision); DYNAMIC: int8 weights, the activation quantized at run time
# (export.dynamic: DynamicQuantizeLinear + MatMulInteger, onnxruntime's DynamicQuantizeMatMul)
# WEIGHT_ONLY: int8 weights (DequantizeLinear in the file), float activations (an edge region: analysis.placement.edges)
INT8, WIDER, FLOAT, DYNAMIC, WEIGHT_ONLY = "int8", "wider", "float", "dynamic", "weight_only"



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
DECISIONS = (INT8, WIDER, FLOAT, DYNAMIC, WEIGHT_ONLY)

_OPT_NUMBER, _STR, _OPT_STR = (int, float, type(None)), (str,), (str, type(None))
_JSON_NAMES = {int: "number", float: "number", str: "string", dict: "object", list: "list", type(None): "null", bool: "boolean"}
# the JSON types of each field of a placement file (required fields first: (types, required))
_PLACEMENT_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "model_sha256": (_STR, True), "platform": (_STR, True), "target": (_STR, True), "host": ((dict,), True),
    "objective": (_STR, True), "max_loss": (_OPT_NUMBER, True), "loss_metric": (_STR, True),
    "regions": ((list,), True), "measured": ((dict,), False), "note": (_STR, False), "format": (_STR, True),
    "repairs": ((list,), False)}
_REPAIR_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "repair": (_STR, True), "loss_before": (_OPT_NUMBER, True), "loss_after": (_OPT_NUMBER, True),
    "kept": ((bool,), True), "seconds": (_OPT_NUMBER, False), "scope": (_STR, False)}
_REGION_FIELDS: dict[str, tuple[tuple[type, ...], bool]] = {
    "anchor": (_STR, True), "op_type": (_STR, True), "ops": ((list,), True), "decision": (_STR, True),
    "reason": (_STR, True), "int8_ms": (_OPT_NUMBER, False), "fp32_ms": (_OPT_NUMBER, False),
    "loss_only": (_OPT_NUMBER, False), "loss_all_but": (_OPT_NUMBER, False), "gain": (_OPT_NUMBER, False),
    "wider_format": (_OPT_STR, False), "wider_gain": (_OPT_NUMBER, False), "dynamic_ms": (_OPT_NUMBER, False)}


def check_fields(data: dict[str, Any], spec: dict[str, tuple[tuple[type, ...], bool]], where: str) -> None:
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
class RepairTrial:
    """One repair placement tried before floating regions (analysis.placement.repair): the all-INT8 loss without it
    (`loss_before`) and with it (`loss_after`), whether it ships (`kept`), its seconds (quantizing again with it and
    one loss pass) and what it changed ('model': a global repair, every region)."""

    repair: str
    loss_before: float | None
    loss_after: float | None
    kept: bool
    seconds: float | None = None
    scope: str = "model"

    def describe(self) -> str:
        """'equalization: loss 0.0297 -> 0.0150 (kept)'."""
        def f(x: float | None) -> str:
            return "-" if x is None else f"{x:.4g}"

        return (f"{self.repair} ({self.scope}): loss {f(self.loss_before)} -> {f(self.loss_after)} "
                f"({'kept' if self.kept else 'not kept'})")


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
    repairs: list[RepairTrial] = field(default_factory=list)

    def kept_repair(self) -> str | None:
        """The repair the shipped model was quantized with (None: plain)."""
        return next((r.repair for r in self.repairs if r.kept), None)

    def float_anchors(self) -> list[str]:
        return [r.anchor for r in self.regions if r.decision == FLOAT]

    def dynamic_anchors(self) -> list[str]:
        """The regions whose activation input is quantized at run time (DYNAMIC)."""
        return [r.anchor for r in self.regions if r.decision == DYNAMIC]

    def weight_only_anchors(self) -> list[str]:
        """The regions with int8 weights and float activations (WEIGHT_ONLY)."""
        return [r.anchor for r in self.regions if r.decision == WEIGHT_ONLY]

    def wider_anchors(self) -> list[str]:
        """The regions that run in the platform's wider format (Platform.wider)."""
        return [r.anchor for r in self.regions if r.decision == WIDER]

    def to_json(self) -> str:
        data = asdict(self)
        data["regions"] = [r.as_dict() for r in self.regions]
        if not self.repairs:
            del data["repairs"]  # files without repairs stay as they were
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
        check_fields(data, _PLACEMENT_FIELDS, f"placement file '{path}'")
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
            check_fields(r, _REGION_FIELDS, where)
            if r["decision"] not in DECISIONS:
                raise ConfigError(f"{where} ('{r['anchor']}'): decision {r['decision']!r} is not one of "
                                  f"{', '.join(DECISIONS)} (lower case); fix the file or measure again")
        try:
            regions = [RegionDecision(**r) for r in data.pop("regions")]
            repairs = []
            for i, r in enumerate(data.pop("repairs", [])):
                if not isinstance(r, dict):
                    raise ConfigError(f"placement file '{path}', repair {i}: must be a JSON object")
                check_fields(r, _REPAIR_FIELDS, f"placement file '{path}', repair {i}")
                repairs.append(RepairTrial(**r))
            return cls(regions=regions, repairs=repairs, **data)
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
                "weight_only_regions": sum(r.decision == WEIGHT_ONLY for r in self.regions),
                "repairs": [asdict(r) for r in self.repairs], "repair": self.kept_repair(),
                "regions": [r.as_dict() for r in self.regions]}

    def markdown(self) -> str:
        """The decision table of the report (--report x.md)."""
        lines = [f"Placement ({self.objective}, max_loss {self.max_loss}, {self.loss_metric}) on {self.host.get('cpu', '?')}"
                 f" ({self.host.get('kernel_family', '?')}): " + ", ".join(f"{k} {v}" for k, v in self.measured.items()),
                 ""]
        if self.note:
            lines += [self.note, ""]
        if self.repairs:
            lines += ["Repairs tried before floating (all-INT8 loss before -> after):", ""]
            lines += [f"- {r.describe()}" for r in self.repairs] + [""]
        if "placed_ms" not in self.measured and "loss_placed" not in self.measured and self.note:
            return "\n".join(lines)  # not measured: no decision table to show
        wider = any(r.wider_gain is not None or r.decision == WIDER for r in self.regions)
        header = ROW_HEADER + ([WIDER_HEADER] if wider else [])
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        lines += ["| " + " | ".join(r.row(wider)) + " |" for r in self.regions]
        return "\n".join(lines) + "\n"

