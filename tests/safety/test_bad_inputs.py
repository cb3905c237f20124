"""User mistakes end in one netquant error line naming the file / option / node, never a traceback."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner
from PIL import Image
from torch import nn

import netquant
import netquant.nn as nqnn
from netquant.cli.main import cli
from netquant.data.calib import ImageOptions, index_limits, load_calibration, model_inputs
from netquant.errors import ConfigError, DataError, ExportError
from tests.helpers.safety_models import conv_relu, images, no_inputs, token_embedding


def invoke(*args: str | Path, env: dict[str, str] | None = None) -> object:
    return CliRunner().invoke(cli, list(map(str, args)), env=env)


def netquant_error(result: object, kind: str) -> str:
    """The output of a run that ended in one `Error (kind): ...` line with status 1 and no traceback."""
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1, result.output
    assert f"Error ({kind}):" in result.output and "Traceback" not in result.output
    return result.output


@pytest.mark.parametrize("case", ["zero_bytes", "dev_null", "no_inputs"])
def test_empty_or_inputless_models_are_model_errors(tmp_path: Path, case: str) -> None:
    path = {"zero_bytes": tmp_path / "e.onnx", "dev_null": Path("/dev/null"), "no_inputs": tmp_path / "n.onnx"}[case]
    if case == "zero_bytes":
        path.write_bytes(b"")
    elif case == "no_inputs":
        onnx.save(no_inputs(), path)
    out = netquant_error(invoke("quantize", path, "--calib", "random", "-o", tmp_path / "q.onnx"), "ModelError")
    assert str(path.name) in out
    assert not (tmp_path / "q.onnx").exists()


@pytest.mark.parametrize(("option", "value", "message"), [
    ("--std", "1e-40,1,1", "too close to 0"), ("--std", "nan,1,1", "--std"), ("--mean", "inf,0,0", "--mean"),
    ("--std", "0,1,1", "contains 0")])
def test_bad_mean_std_are_reported_as_options_not_as_data(tmp_path: Path, option: str, value: str,
                                                           message: str) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(conv_relu(), model)
    folder = tmp_path / "imgs"
    folder.mkdir()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8) + 7).save(folder / "a.png")
    result = invoke("quantize", model, "--calib", folder, "-o", tmp_path / "q.onnx", option, value)
    assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output
    assert "array for input" not in result.output  # not blamed on the data
    assert not (tmp_path / "q.onnx").exists()


def test_image_options_refuse_a_std_whose_inverse_overflows_float32() -> None:
    with pytest.raises(DataError, match="too close to 0"):
        ImageOptions(std=(1e-40,) * 3)
    x = (np.float32(1) - np.float32(0)) / np.float32(1e-30)  # finite: allowed
    assert np.isfinite(x) and ImageOptions(std=(1e-30,) * 3).std[0] == 1e-30


def test_name_selector_error_lists_node_names(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(conv_relu(), model)
    out = netquant_error(invoke("quantize", model, "--calib", "random", "-o", tmp_path / "q.onnx",
                                "--fp32-ops", "name:conv3"), "ConfigError")
    assert "node names present: conv1, relu1, conv2" in out


@pytest.mark.parametrize("cache", ["/proc/x", "a_file"])
def test_an_unusable_cache_is_a_config_error(tmp_path: Path, cache: str) -> None:
    if cache == "a_file":
        cache = str(tmp_path / "a_file")
        Path(cache).write_text("x")
    out = netquant_error(invoke("demo", "-q", env={"NETQUANT_CACHE": cache}), "ConfigError")
    assert cache in out and "NETQUANT_CACHE" in out


def test_random_token_ids_cover_the_embedding_vocabulary(tmp_path: Path) -> None:
    model = tmp_path / "tok.onnx"
    onnx.save(token_embedding(vocab=100), model)
    assert index_limits(model) == {"ids": 100}
    ids = load_calibration("random", model_inputs(model), limit=32, index_limits=index_limits(model))["ids"]
    assert ids.min() >= 0 and ids.max() <= 99 and len(np.unique(ids)) > 80
    result = invoke("quantize", model, "--calib", "random", "-o", tmp_path / "q.onnx", "--allow-float")
    assert result.exit_code == 0, result.output  # Gather only: a float file, written as asked
    assert "smoke test" in result.output


def test_external_data_model_reports_its_real_size(tmp_path: Path) -> None:
    model = tmp_path / "ext.onnx"
    onnx.save(conv_relu(), model, save_as_external_data=True, location="ext.onnx.data", size_threshold=0)
    assert (tmp_path / "ext.onnx.data").stat().st_size > model.stat().st_size
    result = CliRunner().invoke(cli, ["quantize", str(model), "--calib", "random", "-o", str(tmp_path / "q.onnx"),
                                      "--allow-float"], terminal_width=200)  # convs too small for int8: float
    assert result.exit_code == 0, result.output
    line = next(row for row in result.output.splitlines() if "file size" in row)
    ratio = float(line.split("(")[1].split("x smaller")[0])
    total = model.stat().st_size + (tmp_path / "ext.onnx.data").stat().st_size
    assert ratio == pytest.approx(total / (tmp_path / "q.onnx").stat().st_size, abs=0.051)
    assert ratio > 1.0


def test_export_onnx_with_a_wrong_example_is_one_netquant_error(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    torch.manual_seed(0)
    model = nqnn.quantize_model(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()), nqnn.ModelQuantConfig.int8_tensorrt())
    with nqnn.calibrate(model):
        model(torch.randn(2, 3, 8, 8))
    capfd.readouterr()
    with pytest.raises(ExportError, match=r"cannot run on the example inputs \(\[2, 5, 8, 8\]\)"):
        nqnn.export_onnx(model, torch.randn(2, 5, 8, 8), tmp_path / "m.onnx")
    captured = capfd.readouterr()
    assert len((captured.out + captured.err).splitlines()) <= 2
    assert list(tmp_path.iterdir()) == []


def test_config_error_for_bad_option_is_not_data_error() -> None:
    with pytest.raises(ConfigError):
        from netquant.cli.quantize_cmd import _floats

        _floats("1,nan", "std")


def test_netquant_api_on_a_graph_without_inputs_is_a_model_error(tmp_path: Path) -> None:
    onnx.save(no_inputs(), tmp_path / "n.onnx")
    with pytest.raises(netquant.errors.NetquantError):
        netquant.quantize_onnx(str(tmp_path / "n.onnx"), [images(1)], quiet=True)
