"""Every file a run reads is an input of its output plan: calibration files (a folder's images and arrays, the
file given), the placement file, the model and its external data, also for QuantizedModel.export after
os.chdir. Each refusal comes before any work, names the file, and leaves it unchanged."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image

import netquant
from netquant.data.calib import calibration_files
from netquant.errors import ExportError
from tests.helpers.safety_models import conv_relu, images, quantize_cli

quantize = quantize_cli


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def image_folder(folder: Path, n: int = 3) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


def refused(result: object, path: Path) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "ConfigError" in result.output
    assert "is the input file" in result.output and str(path) in result.output


@pytest.mark.parametrize("option", ["--report", "--json", "--placement"])
def test_an_output_over_a_calibration_image_is_refused(model: Path, tmp_path: Path, option: str) -> None:
    imgs = image_folder(tmp_path / "imgs")
    target = imgs / "0.png"
    before = snapshot(tmp_path)
    result = quantize(model, "--calib", imgs, "-o", tmp_path / "q.onnx", option, target)
    refused(result, target)
    assert snapshot(tmp_path) == before  # nothing written, the image intact


def test_minus_o_inside_the_image_folder_is_refused(model: Path, tmp_path: Path) -> None:
    imgs = image_folder(tmp_path / "imgs")
    before = snapshot(tmp_path)
    result = quantize(model, "--calib", imgs, "-o", imgs / "0.png")
    assert result.exit_code == 1 and "Traceback" not in result.output and str(imgs / "0.png") in result.output
    assert snapshot(tmp_path) == before


def test_an_output_over_an_array_file_of_the_calibration_folder_is_refused(model: Path, tmp_path: Path) -> None:
    npy = tmp_path / "npy"
    (npy / "sub").mkdir(parents=True)
    np.save(npy / "s1.npy", images(2))
    np.savez(npy / "sub" / "s2.npz", x=images(2, seed=1))
    before = snapshot(tmp_path)
    for target in (npy / "s1.npy", npy / "sub" / "s2.npz"):
        result = quantize(model, "--calib", npy, "-o", tmp_path / "q.onnx", "--json", target)
        refused(result, target)
    assert snapshot(tmp_path) == before


def test_calibration_files_lists_what_the_loader_may_read(tmp_path: Path) -> None:
    imgs = image_folder(tmp_path / "imgs", 2)
    np.save(imgs / "a.npy", images(1))
    (imgs / "notes.txt").write_text("not read")
    assert calibration_files(imgs) == sorted([imgs / "0.png", imgs / "1.png", imgs / "a.npy"])
    assert calibration_files(imgs / "a.npy") == [imgs / "a.npy"]
    assert calibration_files("random") == [] and calibration_files(tmp_path / "missing") == []


def test_api_export_refuses_the_placement_file_it_read(model: Path, tmp_path: Path) -> None:
    data = [images(1, s) for s in range(4)]
    placement = tmp_path / "placement.json"
    netquant.quantize_onnx(str(model), data, quiet=True, objective="latency").save_placement(placement)
    before = placement.read_bytes()
    qm = netquant.quantize_onnx(str(model), data, quiet=True, placement_from=placement)
    with pytest.raises(ExportError, match="is the input file.*placement.json"):
        qm.export(placement, format="json")
    assert placement.read_bytes() == before


def test_api_export_after_chdir_refuses_the_source_and_its_external_data(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    work.mkdir()
    elsewhere.mkdir()
    onnx.save(conv_relu(), work / "m.onnx", save_as_external_data=True, all_tensors_to_one_file=True,
              location="m.data", size_threshold=0)
    before = snapshot(work)
    monkeypatch.chdir(work)
    qm = netquant.quantize_onnx("m.onnx", [images(1, s) for s in range(4)], quiet=True)  # a relative path
    assert qm.input_files == (work / "m.onnx", work / "m.data")
    monkeypatch.chdir(elsewhere)
    for target in (work / "m.onnx", work / "m.data", Path(os.path.relpath(work / "m.onnx"))):
        with pytest.raises(ExportError, match="is the input file"):
            qm.export(target, format="json")
    assert snapshot(work) == before and snapshot(elsewhere) == {}
    qm.export("q.onnx", allow_float=True)  # relative to the folder of the call
    assert (elsewhere / "q.onnx").is_file()


def test_save_placement_and_plot_report_refuse_the_files_the_run_read(model: Path, tmp_path: Path) -> None:
    data = [images(1, s) for s in range(4)]
    placement = tmp_path / "placement.json"
    netquant.quantize_onnx(str(model), data, quiet=True).save_placement(placement)
    qm = netquant.quantize_onnx(str(model), data, quiet=True, placement_from=placement)
    before = snapshot(tmp_path)
    for target in (placement, model):
        with pytest.raises(ExportError, match="is the input file"):
            qm.save_placement(target)
    assert snapshot(tmp_path) == before
    pytest.importorskip("matplotlib")
    png = tmp_path / "m.png"
    os.link(model, png)  # a hard link to the model under a plot's name
    with pytest.raises(ExportError, match="is the input file"):
        qm.plot_report(png)
    assert png.read_bytes() == model.read_bytes()
