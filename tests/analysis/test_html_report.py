"""The HTML report (analysis.html_report, QuantizedModel.report, `quantize --report x.html`): parsed with html.parser
and compared with qm.summary(), layer_report(), saturation_report() and the export's own report; rendered in
headless Chromium in a slow test."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import onnx
import pytest

from netquant.analysis import markdown_table, saturation_markdown
from netquant.analysis.html_report import (
    SECTIONS,
    SNR_CAP_DB,
    layer_chart_svg,
    vs_fp32_section,
)
from netquant.analysis.layer_error import LayerError
from netquant.api import QuantizedModel, quantize_onnx
from netquant.errors import ConfigError, ExportError
from tests.conftest import CliInvoke
from tests.helpers.export_models import conv_net, images
from tests.helpers.placement_models import conv_stack, stack_batches


@dataclass
class Table:
    cls: str
    section: str
    rows: list[list[str]] = field(default_factory=list)  # header row first


@dataclass
class Shape:
    tag: str
    attrs: dict[str, str]
    title: str = ""


class ReportParser(HTMLParser):
    """Sections, tables (cell texts), SVG bars / points with their <title>, every tag's attributes, page text."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sections: list[str] = []
        self.tables: list[Table] = []
        self.shapes: list[Shape] = []
        self.tags: list[tuple[str, dict[str, str]]] = []
        self.text: list[str] = []
        self._cell: list[str] | None = None
        self._row: list[str] | None = None
        self._shape: Shape | None = None
        self._in_title = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        self.tags.append((tag, a))
        if tag == "section":
            self.sections.append(a.get("id", ""))
        elif tag == "table":
            self.tables.append(Table(a.get("class", ""), self.sections[-1] if self.sections else ""))
        elif tag == "tr":
            self._row = []
        elif tag in ("td", "th") and self._row is not None:
            self._cell = []
        elif tag in ("rect", "circle") and "class" in a and a["class"].split()[0] in ("bar", "pt"):
            self._shape = Shape(tag, a)
            self.shapes.append(self._shape)
        elif tag == "title":
            self._in_title = True

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tr" and self._row is not None:
            self.tables[-1].rows.append(self._row)
            self._row = None
        elif tag in ("rect", "circle"):
            self._shape = None
        elif tag == "title":
            self._in_title = False

    def handle_data(self, data: str) -> None:
        self.text.append(data)
        if self._cell is not None:
            self._cell.append(data)
        if self._in_title and self._shape is not None:
            self._shape.title += data

    def table(self, cls: str) -> list[list[str]]:
        found = [t for t in self.tables if t.cls == cls]
        assert len(found) == 1, f"one table '{cls}' expected, found {len(found)}"
        return found[0].rows

    def facts(self, section: str) -> dict[str, str]:
        """The 'what: value' table of a section."""
        rows = next(t.rows for t in self.tables if t.cls == "facts" and t.section == section)
        return {r[0]: r[1] for r in rows}

    def bars(self) -> list[Shape]:
        return [s for s in self.shapes if s.tag == "rect"]


def parse(path: Path) -> tuple[str, ReportParser]:
    text = path.read_text(encoding="utf-8")
    parser = ReportParser()
    parser.feed(text)
    parser.close()
    return text, parser


def same(text: str, value: float | None, tol: float, rel: bool = False) -> bool:
    """A table cell shows `value` ('-' where it is None) within `tol` (absolute, or relative)."""
    if value is None:
        return text == "-"
    return float(text) == (pytest.approx(value, rel=tol) if rel else pytest.approx(value, abs=tol))


def assert_self_contained(text: str, parser: ReportParser) -> None:
    assert "http://" not in text and "https://" not in text
    for tag, attrs in parser.tags:
        assert tag not in ("script", "link", "iframe", "img", "object", "embed"), tag
        for key in ("src", "href"):
            assert not attrs.get(key) or attrs[key].startswith("#"), (tag, attrs)


@pytest.fixture(scope="module")
def placed() -> QuantizedModel:
    """A model big enough for placement to time it on this machine (measured placement, 3 regions)."""
    return quantize_onnx(conv_stack(), stack_batches(), quiet=True)


def test_report_sections_and_tables_match_the_model(placed: QuantizedModel, tmp_path: Path) -> None:
    export = placed.export(tmp_path / "q.onnx")
    path = placed.report(tmp_path / "r.html")
    text, page = parse(path)
    assert_self_contained(text, page)
    assert page.sections == list(SECTIONS)
    summary = placed.summary()
    model = page.facts("model")
    assert model["ops"] == str(summary["ops"]) == "5" and model["quantized ops"] == str(summary["quantized_ops"])
    assert model["sha256"].startswith("- (not a file")  # built from a ModelProto in memory
    assert page.facts("platform")["platform"] == "onnxruntime_int8"
    host = page.facts("host")
    assert host["CPU"] == summary["placement"]["host"]["cpu"]
    assert host["int8 kernel family (onnxruntime probe)"] == summary["placement"]["host"]["kernel_family"]
    # engine: the export's own validation numbers, for the file it wrote
    engine = page.facts("engine")
    assert engine["file"] == str(tmp_path / "q.onnx") and engine["validated"] == "yes"
    assert engine["int8 kernels / layers in the engine"] == ", ".join(
        f"{k} x{v}" for k, v in export.int8_kernels.items())
    outputs = page.table("engine-outputs")[1:]
    assert [r[0] for r in outputs] == list(export.output_cosine)
    for row in outputs:
        assert float(row[1]) == pytest.approx(export.output_cosine[row[0]], abs=5e-7)
        assert float(row[2]) == pytest.approx(export.output_max_abs_diff[row[0]], rel=1e-3)
    # FP32 vs INT8: every measured key of placement with its value
    measured = summary["placement"]["measured"]
    vs = page.table("vs-fp32")
    assert vs[0] == ["measure", "key", "value"] and [r[1] for r in vs[1:]] == list(measured)
    for row in vs[1:]:
        assert float(row[2]) == pytest.approx(measured[row[1]], rel=1e-5)
    # placement: one row per region, decisions, times, sensitivity as in the summary
    regions = summary["placement"]["regions"]
    rows = page.table("placement")
    assert rows[0][:7] == ["region (anchor op)", "type", "ops", "runs in", "why", "FP32 ms", "INT8 ms"]
    assert [r[0] for r in rows[1:]] == [r["anchor"] for r in regions] == ["conv0", "conv1", "conv2"]
    for row, r in zip(rows[1:], regions):
        assert row[2] == " ".join(r["ops"]) and row[3] == r["decision"] and row[4] == r["reason"]
        assert same(row[5], r["fp32_ms"], 5e-4) and same(row[6], r["int8_ms"], 5e-4)
        assert same(row[7], r["fp32_ms"] / r["int8_ms"] if r["int8_ms"] else None, 5e-3)
        assert same(row[8], r["loss_only"], 5e-3, rel=True) and same(row[9], r["gain"], 5e-3, rel=True)
    # per-layer: the full table is layer_report(), the chart one bar and one point per op output
    errors = placed.layer_report()
    assert page.table("layers")[1:] == [e.row() for e in errors]
    bars = page.bars()
    assert len(bars) == len(errors) == 5
    for bar, e in zip(bars, errors):
        assert bar.title.startswith(f"{e.op} ({e.op_type}, quantized): SNR {e.snr_db:.2f} dB")
    assert len([s for s in page.shapes if s.tag == "circle"]) == len(errors)
    # saturation: saturation_report() row by row
    assert page.table("saturation")[1:] == [r.row() for r in placed.saturation_report()]
    # same model, same bytes
    assert placed.report(tmp_path / "again.html").read_bytes() == path.read_bytes()
    assert not list(tmp_path.glob(".*"))  # no staging file left


@pytest.fixture(scope="module")
def odd_names() -> QuantizedModel:
    """conv_net with node names that are HTML, conv1 kept float (its output exact: SNR inf)."""
    model = conv_net(batch="N")
    rename = {"relu2": '<script>alert("x")</script>', "conv2": "conv<2>&'b'", "add": "a" * 60 + "&add"}
    for node in model.graph.node:
        node.name = rename.get(node.name, node.name)
    calib = images(16)
    return quantize_onnx(model, [{"x": calib[:8]}, {"x": calib[8:]}], quiet=True, force_fp32=("name:conv1",))


def test_names_are_escaped_and_exact_ops_are_clipped(odd_names: QuantizedModel, tmp_path: Path) -> None:
    text, page = parse(odd_names.report(tmp_path / "odd.html"))
    assert_self_contained(text, page)
    assert "<script>" not in text and "conv<2>" not in text and "&lt;script&gt;" in text
    errors = odd_names.layer_report()
    names = [e.op for e in errors]
    assert '<script>alert("x")</script>' in names and "conv<2>&'b'" in names
    assert [r[0] for r in page.table("layers")[1:]] == names  # the parser unescapes them back
    bars = page.bars()
    assert len(bars) == len(errors)
    for bar, e in zip(bars, errors):
        assert bar.title.startswith(e.op + " (")  # the full name, even where the axis label is shortened
    exact = [e for e in errors if e.snr_db == math.inf]
    assert exact and exact[0].op == "conv1"  # the float conv on the float input: exact
    kinds = {e.op: bar.attrs["class"].split()[1] for bar, e in zip(bars, errors)}
    assert kinds["conv1"] == "exact"
    assert {kinds[e.op] for e in errors if e.snr_db < SNR_CAP_DB} <= {"quant", "float"}


def test_chart_axes_by_hand() -> None:
    """SNR 20 and 35 dB and an exact op: axis 0..40 dB (200 px), the exact bar clipped at the top; 1 - cosine
    1e-3 and 1e-5 on a log axis of decades 1e-5..1e-3, cosine 1 on the floor."""
    errors = [LayerError("a", "Conv", "ta", True, 20.0, 1 - 1e-3, 0.1),
              LayerError("b", "Relu", "tb", True, 35.0, 1 - 1e-5, 0.01),
              LayerError("c", "Reshape", "tc", False, math.inf, 1.0, 0.0)]
    page = ReportParser()
    page.feed(layer_chart_svg(errors))
    bars = page.bars()
    heights = [float(b.attrs["height"]) for b in bars]
    assert heights == pytest.approx([100.0, 175.0, 200.0])  # 200 px * v / 40 dB; inf clipped to 40 dB
    assert [b.attrs["class"] for b in bars] == ["bar quant", "bar quant", "bar exact"]
    points = [s for s in page.shapes if s.tag == "circle"]
    ys = [float(p.attrs["cy"]) for p in points]
    assert ys[1] - ys[0] == pytest.approx(140.0)  # two decades = the panel's 140 px
    assert ys[2] == pytest.approx(ys[1]) and points[2].attrs["class"] == "pt floor float"
    # an SNR far above the cap does not stretch the axis; a huge number of ops still gets one bar each
    many = [LayerError(f"op{i}", "Add", f"t{i}", i % 2 == 0, 30.0 + i % 7, 1 - 1e-4, 0.1) for i in range(300)]
    many[5] = LayerError("op5", "Add", "t5", False, 250.0, 1.0 - 1e-12, 0.0)
    page = ReportParser()
    page.feed(layer_chart_svg(many))
    bars = page.bars()
    assert len(bars) == 300 and bars[5].attrs["class"] == "bar clipped"
    assert float(bars[5].attrs["height"]) == pytest.approx(200.0)  # the top: 40 dB, not 250
    points = [s for s in page.shapes if s.tag == "circle"]
    assert len(points) == 300 and points[5].attrs["class"].startswith("pt floor")  # 1 - cosine 1e-12 < COS_FLOOR
    assert float(points[5].attrs["cy"]) == pytest.approx(max(float(p.attrs["cy"]) for p in points))


def test_fp32_vs_int8_from_the_summary_when_measured_in_the_engine() -> None:
    """summary['vs_fp32'] (export.fidelity's comparisons, one per exported file) gives the section's engine tables; the
    placement's measurements follow; with neither the section says so."""
    comparison = {"engine": "onnxruntime", "reference": "source model in onnxruntime", "batches": 2, "samples": 16,
                  "data": "calibration batches", "int8_ms": 0.5, "fp32_ms": 1.25, "timed_batch": 8, "timing_rounds": 5,
                  "seconds": 0.1, "speedup": 2.5,
                  "outputs": [{"name": "y<1>", "cosine": 0.9987123, "max_abs_err": 0.0123, "top1_agreement": 0.975,
                               "top1_positions": 16, "shape": [8, 10]},
                              {"name": "feat", "cosine": 0.99, "max_abs_err": 1.5, "top1_agreement": None,
                               "top1_positions": 0, "shape": [8, 64]}]}
    page = ReportParser()
    page.feed(vs_fp32_section({"vs_fp32": [comparison], "placement": {"measured": {"fp32_ms": 1.0, "placed_ms": 0.4}}}))
    assert page.table("engine-vs-fp32") == [["output", "cosine vs FP32", "max |err| vs FP32", "top-1 agreement"],
                                            ["y<1>", "0.998712", "0.0123", "97.50%"], ["feat", "0.990000", "1.5", "-"]]
    assert page.table("engine-latency")[1] == ["1.25", "0.5", "2.500", "8", "5"]
    assert page.table("vs-fp32")[1:] == [["FP32, sum of profiled nodes (ms)", "fp32_ms", "1"],
                                         ["placed model, sum of profiled nodes (ms)", "placed_ms", "0.4"]]
    assert "INT8 in onnxruntime vs FP32 (source model in onnxruntime): 16 samples" in "".join(page.text)
    page = ReportParser()
    page.feed(vs_fp32_section({"vs_fp32": [], "placement": None}))
    assert not page.tables and "Not measured" in "".join(page.text)


def test_report_paths_are_checked(placed: QuantizedModel, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"unknown extension '\.txt'.*\.html"):
        placed.report(tmp_path / "r.txt")
    with pytest.raises(ExportError, match="does not exist"):
        placed.report(tmp_path / "missing" / "r.html")
    source = tmp_path / "m.onnx"
    onnx.save(conv_stack(), source)
    qm = quantize_onnx(str(source), stack_batches(), quiet=True, objective=None)
    before = source.read_bytes()
    link = tmp_path / "link.html"
    os.link(source, link)  # the model under another name: still the input
    with pytest.raises(ExportError, match="input file"):
        qm.report(link)
    assert source.read_bytes() == before
    _, page = parse(qm.report(tmp_path / "m.html"))
    assert page.facts("model")["sha256"] == hashlib.sha256(before).hexdigest()
    assert page.facts("model")["path"] == str(source.resolve())
    assert "No placement" in "".join(page.text) and "Not exported" in "".join(page.text)


def test_report_writes_markdown_and_png_by_suffix(placed: QuantizedModel, tmp_path: Path) -> None:
    """qm.report(x.md) is the CLI's --report x.md (layer table, placement, saturation); qm.report(x.png) the plot."""
    text = placed.report(tmp_path / "r.md").read_text()
    title = f"per-layer quantization error: {placed.graph.name} on onnxruntime_int8"
    assert text.startswith(f"# {title}\n")
    assert markdown_table(placed.layer_report()) in text and placed.placement.markdown() in text
    assert saturation_markdown(placed.saturation_report()) in text
    placed.report(tmp_path / "r.png")
    placed.plot_report(tmp_path / "same.png", title=title)
    assert (tmp_path / "r.png").read_bytes() == (tmp_path / "same.png").read_bytes()


def test_cli_writes_the_html_report(run_cli: CliInvoke, tmp_path: Path) -> None:
    model, calib = tmp_path / "stack.onnx", tmp_path / "calib.npy"
    onnx.save(conv_stack(), model)
    np.save(calib, np.concatenate(stack_batches()))
    result = run_cli("quantize", model, "--calib", calib, "-o", tmp_path / "q.onnx", "--report", tmp_path / "r.html")
    assert result.exit_code == 0, result.output
    assert "r.html" in result.output
    text, page = parse(tmp_path / "r.html")
    assert_self_contained(text, page)
    assert page.sections == list(SECTIONS)
    assert page.facts("model")["sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    engine = page.facts("engine")
    assert engine["file"] == str(tmp_path / "q.onnx")  # the path asked for, not the staging file
    assert engine["validated in"] == "onnxruntime (optimized, this CPU)"
    assert [r[0] for r in page.table("placement")[1:]] == ["conv0", "conv1", "conv2"]
    assert len(page.bars()) == 5 and len(page.table("saturation")) == 4
    assert not list(tmp_path.glob(".*"))


CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None, reason="no chromium binary on PATH (Debian: apt-get install -y chromium)")
def test_report_renders_in_headless_chromium(placed: QuantizedModel, tmp_path: Path) -> None:
    from PIL import Image

    placed.export(tmp_path / "q.onnx")
    page = placed.report(tmp_path / "r.html")
    shots = {}
    for height in (2000, 4000):  # the brief's window; a taller one that holds the per-layer chart too
        shots[height] = tmp_path / f"shot{height}.png"
        subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--screenshot={shots[height]}",
                        f"--window-size=1200,{height}", page.as_uri()], check=True, capture_output=True, timeout=120)
    with Image.open(shots[2000]) as img:
        assert img.size == (1200, 2000)
        rgb = np.asarray(img.convert("RGB")).astype(int)
    ink = (rgb.min(axis=-1) < 200).mean()  # text, table borders and shading, bars
    assert 0.01 < ink < 0.6, ink
    with Image.open(shots[4000]) as img:
        rgb = np.asarray(img.convert("RGB")).astype(int)
    bars = (np.abs(rgb - np.array([0x1F, 0x77, 0xB4])).max(axis=-1) <= 8).sum()  # QUANT_COLOR bars and points
    assert bars > 5 * 1000, bars  # five quantized op outputs, each bar thousands of pixels
