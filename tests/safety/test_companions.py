"""Companion files (OpenVINO's / ncnn's .bin, ncnn's .table) are never replaced unasked, and an output path
whose suffix names no format (or '-') is refused before any work, naming the path."""

from __future__ import annotations

import stat
from pathlib import Path

import numpy as np
import pytest

import netquant
from netquant.errors import ConfigError, ExportError
from netquant.export.formats import ExportKind
from tests.helpers.safety_models import images, quantize_cli

quantize = quantize_cli


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def openvino_outputs(xml: Path, x: np.ndarray) -> np.ndarray:
    import openvino as ov

    compiled = ov.Core().compile_model(str(xml), "CPU")
    return next(iter(compiled(x).values()))


def test_an_ncnn_export_does_not_replace_the_bin_of_an_openvino_ir(model: Path, tmp_path: Path) -> None:
    pytest.importorskip("openvino")
    out = tmp_path / "out"
    out.mkdir()
    assert quantize(model, "--calib", "random", "-o", out / "m.xml", "-q").exit_code == 0
    x = images(1, seed=3)
    before, y = snapshot(out), openvino_outputs(out / "m.xml", x)
    result = quantize(model, "--calib", "random", "-o", out / "m.param", "-q")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"'{out / 'm.bin'}'" in result.output and "already exists" in result.output and "--overwrite" in result.output
    assert snapshot(out) == before  # no m.param, no m.table, the IR's m.bin untouched
    np.testing.assert_array_equal(openvino_outputs(out / "m.xml", x), y)  # the IR still loads and runs


def test_a_read_only_bin_nobody_named_is_kept_unless_overwrite(model: Path, tmp_path: Path) -> None:
    pytest.importorskip("openvino")
    stale = tmp_path / "a.bin"
    stale.write_bytes(b"firmware")
    stale.chmod(stat.S_IRUSR)
    result = quantize(model, "--calib", "random", "-o", tmp_path / "a.xml")
    assert result.exit_code == 1 and f"'{stale}'" in result.output
    assert stale.read_bytes() == b"firmware" and not (tmp_path / "a.xml").exists()
    result = quantize(model, "--calib", "random", "-o", tmp_path / "a.xml", "--overwrite", "-q")
    assert result.exit_code == 0, result.output
    x = images(1, seed=4)
    y = openvino_outputs(tmp_path / "a.xml", x)
    ref = netquant.quantize_onnx(str(model), [images(1, s) for s in range(4)], quiet=True).run({"x": x},
                                                                                              fake_quant=False)["y"]
    assert np.corrcoef(y.ravel(), ref.numpy().ravel())[0, 1] > 0.99


@pytest.mark.parametrize("name", ["model.bin", "model", "model.table", "-"])
def test_an_output_name_without_a_format_is_refused(model: Path, tmp_path: Path, name: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = quantize(model, "--platform", "openvino_int8", "--calib", "random", "-o", name)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "ConfigError" in result.output and f"'{name}'" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_api_export_keeps_unnamed_companions_and_picks_formats_by_suffix(model: Path, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # '-' names a file in the current folder
    qm = netquant.quantize_onnx(str(model), [images(1, s) for s in range(4)], quiet=True)
    (tmp_path / "a.bin").write_bytes(b"other")
    with pytest.raises(ExportError, match=r"'.*a\.bin'.*already exists.*overwrite=True"):
        qm.export(tmp_path / "a.xml", allow_float=True)
    with pytest.raises(ExportError, match="'.*a.bin'"):
        qm.export(tmp_path / "a.param", allow_float=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.bin", "m.onnx"]
    with pytest.raises(ConfigError, match="'.*q.bin'.*names no format"):
        qm.export(tmp_path / "q.bin")
    with pytest.raises(ExportError, match="'-'"):
        qm.export("-", format="qdq")
    qm.export(tmp_path / "p.json")  # .json: the quant-params JSON, not an ONNX model named .json
    assert "tensors" in (tmp_path / "p.json").read_text() or (tmp_path / "p.json").read_text().lstrip()[0] == "{"
    assert ExportKind.for_path("x.cache") is ExportKind.TENSORRT_CACHE
    with pytest.raises(ConfigError, match="x.json"):
        ExportKind.for_path("x.json", models_only=True, option="-o")


def test_api_export_replaces_companions_when_named_or_allowed(model: Path, tmp_path: Path) -> None:
    pytest.importorskip("openvino")
    qm = netquant.quantize_onnx(str(model), [images(1, s) for s in range(4)], quiet=True)
    qm.export(tmp_path / "a.xml", allow_float=True)
    with pytest.raises(ExportError, match="a.bin"):  # a second export: its .bin exists now
        qm.export(tmp_path / "a.xml", allow_float=True)
    qm.export(tmp_path / "a.xml", overwrite=True, allow_float=True)
    qm.export(tmp_path / "a.xml", bin_path=tmp_path / "a.bin", allow_float=True)  # named: the caller asked for it
    x = images(1, seed=5)
    y = openvino_outputs(tmp_path / "a.xml", x)
    assert np.corrcoef(y.ravel(), qm.run({"x": x})["y"].numpy().ravel())[0, 1] > 0.99


def test_the_default_tensorrt_cache_is_a_companion_too(model: Path, tmp_path: Path) -> None:
    (tmp_path / "q.cache").write_text("another model's cache")
    result = quantize(model, "--platform", "tensorrt_int8", "--calib", "random", "-o", tmp_path / "q.onnx")
    assert result.exit_code == 1 and f"'{tmp_path / 'q.cache'}'" in result.output and "--overwrite" in result.output
    assert (tmp_path / "q.cache").read_text() == "another model's cache" and not (tmp_path / "q.onnx").exists()
    named = quantize(model, "--platform", "tensorrt_int8", "--calib", "random", "-o", tmp_path / "q.onnx",
                     "--trt-cache", tmp_path / "q.cache", "-q")  # named: replaced as asked
    assert named.exit_code == 0, named.output
    assert "TRT-" in (tmp_path / "q.cache").read_text()
