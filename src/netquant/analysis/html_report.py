"""One self-contained HTML report of a quantization run (`--report x.html`, `QuantizedModel.report`).

The file needs nothing else: inline CSS, inline SVG charts drawn here, no script, no network reference. Every name
from the model is escaped (html.escape). Same ReportData in -> same bytes out (no timestamp, no random ids).
Sections, each a function returning HTML: model, host (CPU and its int8 kernel family), platform, engine (the
exported file's validation), FP32 vs INT8, placement (each region's decision, times and sensitivity), per-layer
SNR / cosine (SVG chart and table) and int16 pair saturation.
"""

from __future__ import annotations

import hashlib
import html
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netquant.analysis.layer_error import HEADER as LAYER_HEADER
from netquant.analysis.layer_error import LayerError
from netquant.analysis.report import worst
from netquant.analysis.saturation import HEADER as SATURATION_HEADER
from netquant.analysis.saturation import SaturationRow
from netquant.atomic import write_text_atomic

# chart: SNR bars in dB (a log scale of the signal/noise power ratio) up to SNR_CAP_DB; 1 - cosine on a log axis down
# to COS_FLOOR. Exact op outputs (SNR inf, cosine 1) sit on the cap / floor and are drawn apart, not stretching it.
SNR_CAP_DB, SNR_FLOOR_DB, COS_FLOOR = 80.0, -40.0, 1e-7
QUANT_COLOR, FLOAT_COLOR, EXACT_COLOR, BAD_COLOR = "#1f77b4", "#9a9a9a", "#cfd8e3", "#d62728"
NAMED_TICKS = 40  # up to this many op outputs: names under the bars, else index ticks
LEGEND_WIDTH = 760.0  # the chart is at least this wide, so that its legend fits
SECTIONS = ("model", "host", "platform", "engine", "vs-fp32", "placement", "layers", "saturation", "warnings")

# what the placement's measured keys mean (the "key value" line of the .md report)
MEASURED_LABELS = {
    "source_fp32_wall_ms": "source FP32 model, wall clock (ms per batch-1 run)",
    "all_int8_wall_ms": "all regions INT8 (edge floats float), wall clock (ms)",
    "placed_wall_ms": "placed model, wall clock (ms)",
    "all_float_wall_ms": "all regions float (cleaned graph), wall clock (ms)",
    "fp32_ms": "FP32, sum of profiled nodes (ms)",
    "all_int8_ms": "all regions INT8, sum of profiled nodes (ms)",
    "placed_ms": "placed model, sum of profiled nodes (ms)",
    "placed_ms_estimated": "placed time estimated from per-region times (1 = yes)",
    "speedup_vs_fp32": "speed-up vs FP32 (x)",
    "other_fp32_ms": "nodes outside any region (ms)",
    "loss_all_int8": "loss with every region INT8",
    "loss_all_wider": "loss with every region in the wider format",
    "loss_placed": "loss of the placed model",
    "profiles": "onnxruntime profiles taken",
    "profile_s": "profiling time (s)",
    "loss_passes": "fake-quant loss evaluations",
    "rounds": "wall-clock rounds",
    "seconds": "placement time (s)",
}


@dataclass(frozen=True)
class ModelFacts:
    """The source model: where it came from, its sha256 (None: not a file) and op counts."""

    path: str
    sha256: str | None
    ops: int
    quantized_ops: int
    quantized_by_type: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class HostFacts:
    """This machine: CPU, the int8 kernel family onnxruntime's probe found, and the CPU target it is."""

    cpu: str
    kernel_family: str
    target: str


@dataclass(frozen=True)
class PlatformFacts:
    """The platform the model was quantized for: name, scheme line, CPU target, weight scheme, wider format."""

    name: str
    scheme: str
    cpu_target: str | None = None
    weight_scheme: str | None = None
    wider: str | None = None


@dataclass(frozen=True)
class EngineFacts:
    """How an exported file ran in its engine (from any exporter's report: ONNX, OpenVINO, TFLite, ncnn)."""

    output: str
    validated: bool
    validated_with: str
    engine: str
    reference_only: bool
    batches: int
    cosine: dict[str, float]  # engine vs fake-quant, per output
    max_abs_diff: dict[str, float]
    cosine_fp32: dict[str, float]  # engine vs FP32 where the exporter measured it (ncnn)
    int8: dict[str, int] | None  # int8 kernels / layers in the engine, per type
    heavy_layers: int | None
    runtime_qdq: int | None
    fp32_bytes: int | None
    size_bytes: int | None
    opset: str
    warnings: tuple[str, ...] = ()

    @classmethod
    def from_export(cls, report: Any, output: str | os.PathLike[str] | None = None) -> EngineFacts:
        """Read an export report (ExportReport, TfliteExportReport, NcnnExportReport); `output`: the path the user
        asked for (the report's path may be a staging file)."""
        def get(name: str, default: Any = None) -> Any:
            return getattr(report, name, default)

        source, opset = get("source_opset"), get("opset")
        int8 = get("int8_layers") if get("int8_layers") is not None else get("int8_kernels")
        return cls(output=str(output if output is not None else get("path", "")), validated=bool(get("validated")),
                   validated_with=str(get("validated_with", "") or ""), engine=str(get("engine", "") or ""),
                   reference_only=bool(get("reference_only", False)), batches=int(get("validation_batches", 0) or 0),
                   cosine=dict(get("output_cosine") or {}), max_abs_diff=dict(get("output_max_abs_diff") or {}),
                   cosine_fp32=dict(get("output_cosine_fp32") or {}), int8=dict(int8) if int8 is not None else None,
                   heavy_layers=get("heavy_layers"), runtime_qdq=get("runtime_qdq"), fp32_bytes=get("fp32_bytes"),
                   size_bytes=get("size_bytes"),
                   opset="" if opset is None else (f"{source} -> {opset}" if source and source != opset else str(opset)),
                   warnings=tuple(get("warnings") or ()))


@dataclass(frozen=True)
class ReportData:
    """Everything the HTML report shows; `summary` is QuantizedModel.summary()."""

    title: str
    model: ModelFacts
    host: HostFacts
    platform: PlatformFacts
    summary: Mapping[str, Any]
    layers: Sequence[LayerError]
    saturation: Sequence[SaturationRow] | None = None  # None: the platform runs no CPU int8 kernels
    engine: EngineFacts | None = None  # None: not exported in this session


def file_sha256(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of a file's bytes, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


# ---- HTML building blocks ------------------------------------------------------------------------------------------
def esc(value: Any) -> str:
    """Text as HTML (quotes too: safe in attributes)."""
    return html.escape(str(value), quote=True)


def fmt(value: Any, spec: str = ".6g") -> str:
    """A cell's text: floats with `spec` (inf / nan spelt out), None as '-', anything else str()."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return format(value, spec)
    if isinstance(value, (dict, list, tuple)):
        return ", ".join(f"{k} {fmt(v)}" for k, v in value.items()) if isinstance(value, dict) else \
            ", ".join(fmt(v) for v in value)
    return str(value)


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], cls: str = "") -> str:
    """An HTML table; every cell escaped, numbers right-aligned."""
    head = "".join(f"<th>{esc(h)}</th>" for h in header)
    body = []
    for row in rows:
        cells = []
        for c in row:
            text = c if isinstance(c, str) else fmt(c)
            num = isinstance(c, (int, float)) and not isinstance(c, bool)
            cells.append(f'<td class="num">{esc(text)}</td>' if num else f"<td>{esc(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    attr = f' class="{esc(cls)}"' if cls else ""
    return f"<table{attr}><thead><tr>{head}</tr></thead><tbody>" + "".join(body) + "</tbody></table>\n"


def facts(rows: Iterable[tuple[str, Any]]) -> str:
    """A two-column 'what: value' table."""
    body = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v if isinstance(v, str) else fmt(v))}</td></tr>" for k, v in rows)
    return f'<table class="facts"><tbody>{body}</tbody></table>\n'


def section(sid: str, title: str, body: str) -> str:
    return f'<section id="{esc(sid)}">\n<h2>{esc(title)}</h2>\n{body}</section>\n'


def value_table(value: Any) -> str:
    """Any summary value as HTML: a mapping of mappings or a list of mappings as a table (one row each), a mapping of
    scalars as 'key value' rows, anything else as text."""
    if isinstance(value, Mapping) and value and all(isinstance(v, Mapping) for v in value.values()):
        cols = _columns(value.values())
        return table(["", *cols], ([k, *(_cell(v.get(c)) for c in cols)] for k, v in value.items()))
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, Mapping) for v in value):
        cols = _columns(value)
        return table(cols, ([_cell(v.get(c)) for c in cols] for v in value))
    if isinstance(value, Mapping):
        return facts((str(k), _cell(v)) for k, v in value.items())
    return f"<p>{esc(fmt(value))}</p>\n"


def _columns(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    cols: list[str] = []
    for r in rows:
        cols += [str(k) for k in r if str(k) not in cols]
    return cols


def _cell(v: Any) -> Any:
    return v if isinstance(v, (int, float, str)) or v is None else fmt(v)


# ---- sections ------------------------------------------------------------------------------------------------------
def model_section(m: ModelFacts) -> str:
    by_type = ", ".join(f"{k} {v}" for k, v in m.quantized_by_type.items()) or "none"
    return section("model", "Model", facts([
        ("path", m.path or "-"), ("sha256", m.sha256 or "- (not a file: built in memory)"), ("ops", m.ops),
        ("quantized ops", m.quantized_ops), ("quantized by type", by_type)]))


def host_section(h: HostFacts) -> str:
    return section("host", "This machine", facts([
        ("CPU", h.cpu), ("int8 kernel family (onnxruntime probe)", h.kernel_family), ("CPU target of this machine", h.target)]))


def platform_section(p: PlatformFacts) -> str:
    return section("platform", "Platform", facts([
        ("platform", p.name), ("CPU target of the file", p.cpu_target or "- (the engine is not a CPU int8 kernel set)"),
        ("weight scheme", p.weight_scheme or "-"), ("wider format", p.wider or "none"), ("scheme", p.scheme)]))


def engine_section(e: EngineFacts | None) -> str:
    if e is None:
        return section("engine", "Engine and validation", "<p>Not exported in this session: "
                       "<code>QuantizedModel.export(path)</code> (or <code>netquant quantize -o</code>) runs the file "
                       "in its engine and checks it; this report then shows the result.</p>\n")
    size = (f"{e.fp32_bytes / 1e6:.3f} MB -> {e.size_bytes / 1e6:.3f} MB"
            if e.fp32_bytes and e.size_bytes else "-")
    int8 = "-" if e.int8 is None else (", ".join(f"{k} x{v}" for k, v in e.int8.items()) or "none: runs in float")
    if e.heavy_layers is not None and e.int8 is not None:
        int8 += f" ({sum(e.int8.values())} / {e.heavy_layers} heavy layers)"
    rows: list[tuple[str, Any]] = [
        ("file", e.output), ("validated", "yes" if e.validated else "no"),
        ("validated in", (e.validated_with or "-") + (" (reference semantics only: the target engine does not run "
                                                      "here)" if e.reference_only else "")),
        ("engine", e.engine or e.validated_with or "-"), ("batches compared", e.batches),
        ("int8 kernels / layers in the engine", int8),
        ("Q/DQ left at runtime", "-" if e.runtime_qdq is None else e.runtime_qdq),
        ("file size", size), ("opset", e.opset or "-")]
    outputs = list(dict.fromkeys([*e.cosine, *e.max_abs_diff, *e.cosine_fp32]))
    header = ["output", "cosine engine vs fake-quant", "max |diff| engine vs fake-quant"] + (
        ["cosine engine vs FP32"] if e.cosine_fp32 else [])
    per_output = table(header, ([o, _num(e.cosine.get(o), ".6f"), _num(e.max_abs_diff.get(o), ".4g")]
                                + ([_num(e.cosine_fp32.get(o), ".6f")] if e.cosine_fp32 else []) for o in outputs),
                       cls="engine-outputs")
    warn = "".join(f"<li>{esc(w)}</li>" for w in e.warnings)
    return section("engine", "Engine and validation", facts(rows) + per_output + (f"<ul>{warn}</ul>\n" if warn else ""))


def _num(v: float | None, spec: str) -> str:
    return fmt(v, spec)


def vs_fp32_section(summary: Mapping[str, Any]) -> str:
    """FP32 vs INT8: summary['vs_fp32'] (each exported file in its engine vs FP32) where present, and the placement's
    measured FP32 / INT8 times and losses (the 'key value' line of the .md report) where placement measured."""
    engine = summary.get("vs_fp32")
    measured = (summary.get("placement") or {}).get("measured") or {}
    body = ""
    if engine:
        comparisons = engine if isinstance(engine, (list, tuple)) else [engine]
        body += "".join(engine_comparison(c) if isinstance(c, Mapping) and "outputs" in c else value_table(c)
                        for c in comparisons)
    if measured:
        rows = [[MEASURED_LABELS.get(k, k), k, v] for k, v in measured.items()]
        body += ("<h3>Placement's measurements</h3>\n<p>Measured by placement on this machine: onnxruntime timings "
                 "(batch 1, one thread) and the fake-quant loss on calibration samples.</p>\n"
                 + table(["measure", "key", "value"], rows, cls="vs-fp32"))
    if not body:
        body = ("<p>Not measured in this run (no export compared in its engine, and placement did not time or "
                "compare the model; see the engine section for the exported file's agreement).</p>\n")
    return section("vs-fp32", "FP32 vs INT8", body)


def engine_comparison(c: Mapping[str, Any]) -> str:
    """One exported file in its engine vs FP32 (export.fidelity's EngineComparison.as_dict()): per output cosine,
    max |error| and top-1 agreement; FP32 / INT8 latency where the engine was timed."""
    what = (f"INT8 in {c.get('engine', '?')} vs FP32 ({c.get('reference', 'the source model')}): "
            f"{fmt(c.get('samples'))} samples of the {c.get('data', 'calibration batches')}")
    outputs = table(["output", "cosine vs FP32", "max |err| vs FP32", "top-1 agreement"],
                    ([o.get("name", ""), _num(o.get("cosine"), ".6f"), _num(o.get("max_abs_err"), ".4g"),
                      "-" if o.get("top1_agreement") is None else f"{100 * o['top1_agreement']:.2f}%"]
                     for o in c.get("outputs") or []), cls="engine-vs-fp32")
    speed = ""
    if c.get("int8_ms") is not None and c.get("fp32_ms") is not None:
        speed = table(["FP32 ms", "INT8 ms", "FP32 / INT8", "batch", "rounds (median)"],
                      [[_num(c["fp32_ms"], ".4g"), _num(c["int8_ms"], ".4g"), _num(c.get("speedup"), ".3f"),
                        fmt(c.get("timed_batch")), fmt(c.get("timing_rounds"))]], cls="engine-latency")
    return f"<h3>{esc(what)}</h3>\n" + outputs + speed


def placement_section(summary: Mapping[str, Any]) -> str:
    p = summary.get("placement")
    if not p:
        return section("placement", "Placement", "<p>No placement: the platform's rules alone decided "
                       "(objective none).</p>\n")
    head = facts([("objective", p.get("objective")), ("max loss", p.get("max_loss")),
                  ("loss metric", p.get("loss_metric")),
                  ("regions", f"{p.get('int8_regions', 0)} INT8, {p.get('wider_regions', 0)} wider, "
                              f"{p.get('float_regions', 0)} float, {p.get('weight_only_regions', 0)} weight-only"),
                  *((f"host {k}", v) for k, v in (p.get("host") or {}).items()), ("note", p.get("note") or "-")])
    regions = p.get("regions") or []
    wider = any(r.get("wider_gain") is not None or r.get("decision") == "wider" for r in regions)
    header = ["region (anchor op)", "type", "ops", "runs in", "why", "FP32 ms", "INT8 ms", "FP32 / INT8",
              "loss if only it is int8", "loss saved if float"] + (["loss saved if only it is wider"] if wider else [])
    rows = []
    for r in regions:
        f32, i8 = r.get("fp32_ms"), r.get("int8_ms")
        runs = r.get("decision", "?") + (f": {r['wider_format']}" if r.get("wider_format") else "")
        rows.append([r.get("anchor", ""), r.get("op_type", ""), " ".join(r.get("ops") or []), runs,
                     r.get("reason", ""), _num(f32, ".3f"), _num(i8, ".3f"),
                     _num(f32 / i8 if f32 is not None and i8 else None, ".2f"),
                     _num(r.get("loss_only"), ".2e"), _num(r.get("gain"), ".2e")]
                    + ([_num(r.get("wider_gain"), ".2e")] if wider else []))
    extra = "".join(f"<h3>{esc(title)}</h3>\n" + value_table(summary[key])
                    for key, title in (("int8_regions", "Regions in INT8"), ("float_reasons", "Why regions stay float"))
                    if summary.get(key))
    return section("placement", "Placement: each region's decision",
                   head + table(header, rows, cls="placement") + extra)


def layers_section(errors: Sequence[LayerError], top: int = 10) -> str:
    if not errors:
        return section("layers", "Per-layer error", "<p>No float op outputs to compare.</p>\n")
    n_q = sum(e.quantized for e in errors)
    intro = (f"<p>FP32 vs fake-quant output of every op ({len(errors)} op outputs, {n_q} quantized), first calibration "
             "batch; SNR dB = 10 log10(sum x^2 / sum (x - x_q)^2). Hover a bar or point for the op's full name.</p>\n")
    low = table(LAYER_HEADER, (e.row() for e in worst(errors, top)), cls="worst")
    full = table(LAYER_HEADER, (e.row() for e in errors), cls="layers")
    return section("layers", "Per-layer error", intro + '<div class="chart">' + layer_chart_svg(errors) + "</div>\n"
                   + f"<h3>{min(top, len(errors))} lowest SNR</h3>\n" + low
                   + f"<details><summary>all {len(errors)} op outputs</summary>\n{full}</details>\n")


def saturation_section(rows: Sequence[SaturationRow] | None, cpu_target: str | None) -> str:
    title = "int16 pair saturation on x86 CPUs without VNNI"
    if rows is None:
        return section("saturation", title, "<p>Not applicable: this platform's engine runs no CPU u8 x s8 "
                       "kernels.</p>\n")
    intro = ("<p>Per int8-kernel op, on the first calibration batch: weight pairs whose products can overflow "
             "onnxruntime's int16 pair sums with full-range int8 weights (<code>--target x86-vnni</code>) and with "
             f"this file's weights (CPU target '{esc(cpu_target or '-')}'), the share of outputs full-range weights "
             "change there, and the signal/saturation ratio.</p>\n")
    return section("saturation", title, intro + (table(SATURATION_HEADER, (r.row() for r in rows), cls="saturation")
                                                 if rows else "<p>No int8-kernel ops.</p>\n"))


def warnings_section(summary: Mapping[str, Any]) -> str:
    items = list(summary.get("warnings") or [])
    body = ("<ul>" + "".join(f"<li>{esc(w)}</li>" for w in items) + "</ul>\n") if items else "<p>None.</p>\n"
    return section("warnings", "Warnings", body)


# ---- the per-layer chart -------------------------------------------------------------------------------------------
def _short(name: str, limit: int = 28) -> str:
    return name if len(name) <= limit else f"{name[:limit // 2 - 1]}...{name[-(limit // 2 - 2):]}"


def _snr_axis(values: Sequence[float]) -> tuple[float, float]:
    finite = [v for v in values if math.isfinite(v)]
    hi = min(SNR_CAP_DB, 10 * math.ceil(max(finite) / 10)) if finite else 10.0
    lo = max(SNR_FLOOR_DB, min(0.0, 10 * math.floor(min(finite) / 10))) if finite else 0.0
    return lo, max(hi, lo + 10)


def _cos_axis(dist: Sequence[float]) -> tuple[float, float]:
    """Decades of 1 - cosine: from the lowest positive distance (not below COS_FLOOR) to the highest (<= 1)."""
    pos = [d for d in dist if math.isfinite(d) and d > 0]
    # 1e-6 of a decade of slack: 1 - (1 - 1e-3) is 1.0000000000000009e-3 in float64, still the 1e-3 decade
    lo = max(math.log10(COS_FLOOR), math.floor(math.log10(min(pos)) + 1e-6)) if pos else math.log10(COS_FLOOR)
    hi = min(0.0, math.ceil(math.log10(max(pos)) - 1e-6)) if pos else lo + 1
    return lo, max(hi, lo + 1)


def layer_chart_svg(errors: Sequence[LayerError]) -> str:
    """Two panels in graph order: SNR (dB) bars, one <rect class="bar"> per op output, and 1 - cosine on a log axis,
    one <circle> per op output; each with a <title> (full op name, type, values). SNR above the axis top (exact ops:
    inf) is drawn to the top in a light colour; 1 - cosine below COS_FLOOR sits on the floor, hollow."""
    n = len(errors)
    slot = max(4.0, min(40.0, 1000.0 / n))
    left, right, top = 64.0, 16.0, 34.0
    h_snr, h_cos, gap = 200.0, 140.0, 36.0
    named = n <= NAMED_TICKS
    # rotated names (-60 degrees, about 6.2 px per character) need their length * sin 60 below the axis
    bottom = 20.0 + 5.4 * max(len(_short(e.op)) for e in errors) if named else 40.0
    width = max(left + slot * n + right, LEGEND_WIDTH)
    height = top + h_snr + gap + h_cos + bottom
    out = [f'<svg class="layer-chart" width="{width:.0f}" height="{height:.0f}" '
           f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="sans-serif" font-size="11">']
    # SNR panel
    lo, hi = _snr_axis([e.snr_db for e in errors])

    def y_snr(v: float) -> float:
        return top + h_snr * (hi - min(max(v, lo), hi)) / (hi - lo)

    step = 10 if hi - lo <= 80 else 20
    out.append(_panel_frame(left, top, slot * n, h_snr, "SNR (dB)",
                            [(y_snr(t), f"{t:g}") for t in range(int(lo), int(hi) + 1, step)]))
    y0 = y_snr(0.0)
    for i, e in enumerate(errors):
        v = e.snr_db
        kind = "quant" if e.quantized else "float"
        if math.isnan(v):
            kind, shown = "nan", 0.0
        elif v > hi:
            kind, shown = ("exact" if v == math.inf else "clipped"), hi
        elif v < lo:
            kind, shown = "low", lo
        else:
            shown = v
        ya, yb = sorted((y0, y_snr(shown)))
        x = left + slot * i + slot * 0.12
        tip = f"{e.op} ({e.op_type}, {'quantized' if e.quantized else 'float'}): SNR {fmt(v, '.2f')} dB, " \
              f"cosine {fmt(e.cosine, '.6f')}, max |err| {fmt(e.max_abs_error, '.4g')}"
        out.append(f'<rect class="bar {kind}" x="{x:.2f}" y="{ya:.2f}" width="{slot * 0.76:.2f}" '
                   f'height="{max(yb - ya, 0.0):.2f}"><title>{esc(tip)}</title></rect>')
    # 1 - cosine panel (log axis)
    c_top = top + h_snr + gap
    dist = [1.0 - e.cosine for e in errors]
    clo, chi = _cos_axis(dist)

    def y_cos(d: float) -> float:
        lg = math.log10(d) if d > 0 and math.isfinite(d) else clo
        return c_top + h_cos * (chi - min(max(lg, clo), chi)) / (chi - clo)

    out.append(_panel_frame(left, c_top, slot * n, h_cos, "1 - cosine (log)",
                            [(y_cos(10.0 ** k), f"1e{k}") for k in range(int(clo), int(chi) + 1)]))
    points = [(left + slot * (i + 0.5), y_cos(d)) for i, d in enumerate(dist)]
    out.append('<polyline class="cos-line" fill="none" stroke="#bbbbbb" stroke-width="1" points="'
               + " ".join(f"{x:.2f},{y:.2f}" for x, y in points) + '"/>')
    for e, d, (x, y) in zip(errors, dist, points):
        floor = not (math.isfinite(d) and d >= COS_FLOOR)
        cls = ("floor " if floor else "") + ("quant" if e.quantized else "float")
        out.append(f'<circle class="pt {cls}" cx="{x:.2f}" cy="{y:.2f}" r="{min(4.0, slot * 0.4):.2f}">'
                   f"<title>{esc(e.op)}: cosine {esc(fmt(e.cosine, '.8f'))}</title></circle>")
    # x axis: names (few ops) or index ticks
    y_axis = c_top + h_cos
    if named:
        for i, e in enumerate(errors):
            x = left + slot * (i + 0.5)
            out.append(f'<text class="op-name" x="{x:.2f}" y="{y_axis + 8:.2f}" text-anchor="end" '
                       f'transform="rotate(-60 {x:.2f} {y_axis + 8:.2f})">{esc(_short(e.op))}'
                       f"<title>{esc(e.op)}</title></text>")
    else:
        every = max(1, 10 ** math.floor(math.log10(max(n / 10, 1))))
        for i in range(0, n, every):
            x = left + slot * (i + 0.5)
            out.append(f'<text x="{x:.2f}" y="{y_axis + 14:.2f}" text-anchor="middle">{i}</text>')
        out.append(f'<text x="{left + slot * n / 2:.2f}" y="{y_axis + 30:.2f}" text-anchor="middle">op output '
                   "index (graph order)</text>")
    out.append(_legend(left, top - 12))
    out.append("</svg>")
    return "\n".join(out)


def _panel_frame(x: float, y: float, w: float, h: float, label: str, ticks: list[tuple[float, str]]) -> str:
    parts = [f'<rect class="frame" x="{x:.2f}" y="{y:.2f}" width="{w:.2f}" height="{h:.2f}" fill="none" '
             'stroke="#999999"/>']
    for ty, text in ticks:
        parts.append(f'<line x1="{x:.2f}" x2="{x + w:.2f}" y1="{ty:.2f}" y2="{ty:.2f}" stroke="#eeeeee"/>'
                     f'<text x="{x - 4:.2f}" y="{ty + 4:.2f}" text-anchor="end">{esc(text)}</text>')
    parts.append(f'<text x="12" y="{y + h / 2:.2f}" text-anchor="middle" transform="rotate(-90 12 {y + h / 2:.2f})">'
                 f"{esc(label)}</text>")
    return "".join(parts)


def _legend(x: float, y: float) -> str:
    items = [("quant", QUANT_COLOR, "quantized op"), ("float", FLOAT_COLOR, "float op"),
             ("exact", EXACT_COLOR, f"exact (SNR inf) / above {SNR_CAP_DB:g} dB, clipped"),
             ("low", BAD_COLOR, f"below {SNR_FLOOR_DB:g} dB, clipped")]
    parts, cx = [], x
    for _, color, text in items:
        parts.append(f'<rect x="{cx:.2f}" y="{y - 8:.2f}" width="10" height="10" fill="{color}"/>'
                     f'<text x="{cx + 14:.2f}" y="{y + 1:.2f}">{esc(text)}</text>')
        cx += 28 + 5.0 * len(text)
    return "".join(parts)


# ---- the page ------------------------------------------------------------------------------------------------------
CSS = f"""
body {{ font-family: sans-serif; margin: 24px; color: #222; max-width: 1400px; }}
h1 {{ font-size: 22px; }} h2 {{ font-size: 18px; border-bottom: 1px solid #ddd; padding-bottom: 4px; margin-top: 28px; }}
h3 {{ font-size: 15px; }}
table {{ border-collapse: collapse; margin: 8px 0; font-size: 13px; }}
th, td {{ border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }}
thead th {{ background: #f3f5f8; }}
table.facts th {{ background: #f7f7f7; font-weight: 600; white-space: nowrap; }}
td.num {{ text-align: right; font-variant-numeric: tabular-nums; }}
nav a {{ margin-right: 12px; }}
.chart {{ overflow-x: auto; border: 1px solid #eee; padding: 4px; }}
rect.bar.quant, circle.pt.quant {{ fill: {QUANT_COLOR}; }}
rect.bar.float, circle.pt.float {{ fill: {FLOAT_COLOR}; }}
rect.bar.exact, rect.bar.clipped {{ fill: {EXACT_COLOR}; }}
rect.bar.low {{ fill: {BAD_COLOR}; }}
circle.pt.floor {{ fill: #ffffff; stroke: #555555; }}
code {{ background: #f5f5f5; padding: 0 3px; }}
"""


def render_html(data: ReportData) -> str:
    """The whole report as one HTML document."""
    nav = " ".join(f'<a href="#{s}">{s}</a>' for s in SECTIONS)
    body = [model_section(data.model), host_section(data.host), platform_section(data.platform),
            engine_section(data.engine), vs_fp32_section(data.summary), placement_section(data.summary),
            layers_section(data.layers), saturation_section(data.saturation, data.platform.cpu_target),
            warnings_section(data.summary)]
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{esc(data.title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            f"<h1>{esc(data.title)}</h1>\n<nav>{nav}</nav>\n" + "".join(body) + "</body>\n</html>\n")


def write_html_report(data: ReportData, path: str | os.PathLike[str]) -> Path:
    """Write render_html(data) to `path` whole or not at all."""
    return write_text_atomic(path, render_html(data), "HTML report")
