"""Per-layer error report: the PNG plot (plot_layer_errors / QuantizedModel.plot_report) and `quantize --report`."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from PIL import Image

from netquant.analysis import LayerError, plot_layer_errors
from netquant.analysis.plot import QUANT_BAND, WORST_COLOR
from netquant.api import QuantizedModel, quantize_onnx
from netquant.errors import ConfigError, DataError, ExportError
from tests.conftest import CliInvoke
from tests.helpers.export_models import conv_net, images

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BATCH = 8


@pytest.fixture(scope="module")
def calib() -> np.ndarray:
    return images(16)


@pytest.fixture(scope="module")
def qm(calib: np.ndarray) -> QuantizedModel:
    """The same quantization the CLI does with --batch-size 8 on the same samples."""
    return quantize_onnx(conv_net(batch="N"), [{"x": calib[:BATCH]}, {"x": calib[BATCH:]}], quiet=True,
                         batch_size=BATCH)


@pytest.fixture()
def model_and_calib(tmp_path: Path, calib: np.ndarray) -> tuple[Path, Path]:
    onnx.save(conv_net(batch="N"), tmp_path / "net.onnx")
    np.save(tmp_path / "calib.npy", calib)
    return tmp_path / "net.onnx", tmp_path / "calib.npy"


def _pixels_near(img: Image.Image, hex_color: str, tol: int = 6) -> int:
    rgb = np.asarray(img.convert("RGB")).astype(int)
    target = np.array([int(hex_color[i:i + 2], 16) for i in (1, 3, 5)])
    return int((np.abs(rgb - target).max(axis=-1) <= tol).sum())


def _assert_png(path: Path, size: tuple[int, int]) -> Image.Image:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    with Image.open(path) as img:
        assert img.format == "PNG" and img.size == size
        img.load()
        return img.copy()


# 9 op outputs: figure 8 x 7 inches at 110 dpi
SMALL_PNG_SIZE = (880, 770)


def test_plot_report_writes_a_readable_deterministic_png(qm: QuantizedModel, tmp_path: Path) -> None:
    errors = qm.plot_report(tmp_path / "a.png")
    qm.plot_report(tmp_path / "b.png")
    assert errors == qm.layer_report() and len(errors) == len(qm.graph.nodes)
    img = _assert_png(tmp_path / "a.png", SMALL_PNG_SIZE)
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()
    # quantized columns are shaded and the worst layers circled in red
    assert _pixels_near(img, QUANT_BAND, tol=2) > 1000 and _pixels_near(img, WORST_COLOR, tol=40) > 100
    assert not list(tmp_path.glob(".*.tmp"))  # no temp file left behind
    # a new title changes the picture, the same inputs never do
    qm.plot_report(tmp_path / "c.png", title="other title")
    assert (tmp_path / "c.png").read_bytes() != (tmp_path / "a.png").read_bytes()


def test_plot_handles_infinite_and_nan_values_and_many_layers(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    errors = [LayerError(f"block{i // 4}.op{i}", "Conv", f"t{i}", i % 3 == 0, float(30 + 5 * rng.standard_normal()),
                         float(1 - 1e-3 * rng.random()), 0.1) for i in range(120)]
    errors[0] = LayerError("exact", "Relu", "t0", False, math.inf, 1.0, 0.0)
    errors[1] = LayerError("zero_signal", "Mul", "t1", True, -math.inf, 0.0, 1.0)
    errors[2] = LayerError("nan", "Add", "t2", False, math.nan, math.nan, math.nan)
    path = plot_layer_errors(errors, tmp_path / "many.png", top=3)
    width = round(min(22.0, 4.0 + 0.16 * 120) * 110)
    _assert_png(path, (width, 770))
    plot_layer_errors(errors, tmp_path / "unlabelled.png", top=0)
    assert (tmp_path / "unlabelled.png").read_bytes() != path.read_bytes()


def test_plot_bad_arguments_are_clear_errors(qm: QuantizedModel, tmp_path: Path) -> None:
    errors = qm.layer_report()
    with pytest.raises(ConfigError, match=r"'.*layers\.pdf' should end in \.png"):
        plot_layer_errors(errors, tmp_path / "layers.pdf")
    with pytest.raises(DataError, match="no per-layer errors to plot"):
        plot_layer_errors([], tmp_path / "empty.png")
    with pytest.raises(ConfigError, match="top must be >= 0"):
        plot_layer_errors(errors, tmp_path / "neg.png", top=-1)
    with pytest.raises(ExportError, match="folder .*missing.* does not exist"):
        plot_layer_errors(errors, tmp_path / "missing" / "x.png")
    assert not list(tmp_path.iterdir())


def test_missing_matplotlib_says_how_to_install_it(run_cli: CliInvoke, qm: QuantizedModel, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   model_and_calib: tuple[Path, Path]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` sees when it is not installed
    with pytest.raises(ConfigError, match=r"pip install 'netquant\[plots\]'"):
        qm.plot_report(tmp_path / "layers.png")
    model, calib = model_and_calib
    result = run_cli("quantize", model, "--calib", calib, "-o", tmp_path / "q.onnx", "--report", tmp_path / "l.png")
    assert result.exit_code == 1 and "netquant[plots]" in result.output
    assert not (tmp_path / "layers.png").exists() and not (tmp_path / "l.png").exists()
    assert not (tmp_path / "q.onnx").exists()


def _markdown_rows(text: str) -> dict[str, list[str]]:
    rows = [re.split(r"(?<!\\)\|", line)[1:-1] for line in text.splitlines() if line.startswith("| ")]
    header, body = [c.strip().replace("\\|", "|") for c in rows[0]], rows[1:]
    assert header == ["op", "type", "quant", "SNR dB", "cosine", "max |err|"]
    return {cells[0].strip(): [c.strip() for c in cells] for cells in body}


def _onnxruntime_tensor(model: onnx.ModelProto, name: str, x: np.ndarray) -> np.ndarray:
    """FP32 value of an intermediate tensor, computed by onnxruntime on the original model."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    model.graph.output.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, None))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run([name], {"x": x})[0]


def test_cli_markdown_report_matches_hand_computed_snr_and_cosine(run_cli: CliInvoke,
        qm: QuantizedModel, calib: np.ndarray, model_and_calib: tuple[Path, Path], tmp_path: Path) -> None:
    model, calib_path = model_and_calib
    report = tmp_path / "layers.md"
    result = run_cli("quantize", model, "--calib", calib_path, "-o", tmp_path / "q.onnx", "--batch-size", BATCH,
                     "--report", report)
    assert result.exit_code == 0, result.output
    assert "also wrote" in result.output and "layers.md" in result.output
    text, saturation = report.read_text().split("## int16 pair saturation on x86 CPUs without VNNI")
    assert text.startswith("# per-layer quantization error: net.onnx on onnxruntime_int8")
    sat_rows = [[c.strip() for c in line.split("|")[1:-1]] for line in saturation.splitlines()
                if line.startswith("| ")][1:]
    expected = qm.saturation_report({"x": calib[:BATCH]})
    assert [r[0] for r in sat_rows] == [r.op for r in expected] and expected
    for cells, row in zip(sat_rows, expected):
        assert cells[2] == f"{row.full_int8_overflow_pairs}/{row.pairs}" and cells[3] == "0"  # target any: safe
        assert float(cells[4]) == pytest.approx(100 * row.saturated_outputs, abs=0.006)
    rows = _markdown_rows(text)
    assert list(rows) == [n.name for n in qm.graph.nodes]  # graph order, every op
    relu2 = rows["relu2"]
    assert relu2[1:3] == ["Relu", "int"]
    # by hand on the first calibration batch: FP32 from onnxruntime, fake-quant from the quantized graph
    x = calib[:BATCH]
    ref = _onnxruntime_tensor(conv_net(batch="N"), "r2", x).astype(np.float64).ravel()
    q = qm.qgraph.executor(fake_quant=True).run({"x": x}, outputs=["r2"])["r2"].double().numpy().ravel()
    snr = 10 * math.log10(float((ref ** 2).sum()) / float(((ref - q) ** 2).sum()))
    cos = float(ref @ q) / (np.linalg.norm(ref) * np.linalg.norm(q))
    assert 20 < snr < 80 and cos < 1.0
    assert float(relu2[3]) == pytest.approx(snr, abs=0.005 + 1e-3)  # table: 2 decimals
    assert float(relu2[4]) == pytest.approx(cos, abs=5e-6 + 1e-6)  # table: 5 decimals
    assert float(relu2[5]) == pytest.approx(float(np.abs(ref - q).max()), rel=1e-3, abs=1e-5)


def test_cli_png_report_and_unknown_extension(run_cli: CliInvoke, model_and_calib: tuple[Path, Path], tmp_path: Path) -> None:
    model, calib = model_and_calib
    out = tmp_path / "q.onnx"
    result = run_cli("quantize", model, "--calib", calib, "-o", out, "--report", tmp_path / "layers.png", "--quiet")
    assert result.exit_code == 0, result.output
    _assert_png(tmp_path / "layers.png", SMALL_PNG_SIZE)
    out.unlink()
    bad = run_cli("quantize", model, "--calib", calib, "-o", out, "--report", tmp_path / "layers.txt")
    assert bad.exit_code == 1
    assert "--report" in bad.output and "unknown extension '.txt'" in bad.output
    assert ".md" in bad.output and ".png" in bad.output
    assert not out.exists() and not (tmp_path / "layers.txt").exists()  # failed before calibrating
    assert "--report" in run_cli("quantize", "--help").output
