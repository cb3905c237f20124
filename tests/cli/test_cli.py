"""`netquant` command line: quantize, platforms, and the bad-input cases."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from PIL import Image

from netquant.platforms import list_platforms
from tests.conftest import CliInvoke
from tests.helpers.export_models import conv_with_runtime_weight, images


@pytest.fixture()
def model(conv_net_file: Path) -> Path:
    """conv_net with the static input x[1, 3, 16, 16], as a file."""
    return conv_net_file


def test_platforms_lists_every_platform_with_its_scheme(run_cli: CliInvoke) -> None:
    result = run_cli("platforms", "--names")
    assert result.exit_code == 0
    assert result.output.split() == list_platforms()
    table = run_cli("platforms")
    assert table.exit_code == 0 and "uint8" in table.output and "affine" in table.output
    assert all(name in table.output for name in list_platforms())


def test_quantize_from_npy_writes_model_json_and_trt_cache(run_cli: CliInvoke, model: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "calib.npy", images(16))
    out = tmp_path / "out.onnx"
    result = run_cli("quantize", model, "--calib", tmp_path / "calib.npy", "-o", out, "--json", tmp_path / "p.json",
                 "--trt-cache", tmp_path / "c.cache")
    assert result.exit_code == 0, result.output
    assert "QLinearConv x" in result.output and "ops quantized" in result.output
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": images(1, seed=5)})[0]
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": images(1, seed=5)})[0]
    assert np.corrcoef(y.ravel(), ref.ravel())[0, 1] > 0.99
    assert (tmp_path / "p.json").stat().st_size > 0
    assert (tmp_path / "c.cache").read_text().startswith("TRT-")


def test_quantize_from_image_folder_and_random(run_cli: CliInvoke, model: Path, tmp_path: Path) -> None:
    folder = tmp_path / "imgs"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        Image.fromarray(rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    out = tmp_path / "img.onnx"
    result = run_cli("quantize", model, "--calib", folder, "-o", out, "--mean", "0.485,0.456,0.406",
                 "--std", "0.229,0.224,0.225", "--channel-order", "bgr", "--quiet")
    assert result.exit_code == 0, result.output
    assert out.exists() and result.output == ""
    result = run_cli("quantize", model, "--calib", "random", "--num-calib", "4", "-o", tmp_path / "r.onnx", "-q")
    assert result.exit_code == 0 and (tmp_path / "r.onnx").exists()


def test_unknown_platform_lists_the_valid_ones(run_cli: CliInvoke, model: Path, tmp_path: Path) -> None:
    result = run_cli("quantize", model, "--platform", "nosuch", "--calib", "random", "-o", tmp_path / "o.onnx")
    assert result.exit_code == 1
    assert "unknown platform 'nosuch'" in result.output
    assert all(name in result.output for name in list_platforms())
    assert not (tmp_path / "o.onnx").exists()


def test_wrong_shape_calibration_names_input_and_expected_shape(run_cli: CliInvoke, model: Path, tmp_path: Path) -> None:
    np.save(tmp_path / "bad.npy", np.zeros((4, 3, 16, 15), np.float32))
    result = run_cli("quantize", model, "--calib", tmp_path / "bad.npy", "-o", tmp_path / "o.onnx")
    assert result.exit_code == 1
    assert "'x' [1, 3, 16, 16]" in result.output and "dim 3 must be 16" in result.output
    assert not (tmp_path / "o.onnx").exists()


def test_missing_calibration_and_bad_mean_are_data_errors(run_cli: CliInvoke, model: Path, tmp_path: Path) -> None:
    result = run_cli("quantize", model, "--calib", tmp_path / "none", "-o", tmp_path / "o.onnx")
    assert result.exit_code == 1 and "DataError" in result.output and "does not exist" in result.output
    result = run_cli("quantize", model, "--calib", "random", "--mean", "a,b", "-o", tmp_path / "o.onnx")
    assert result.exit_code == 1 and "--mean" in result.output


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_unsupported_op_stays_fp32_with_warning_and_fails_with_strict(run_cli: CliInvoke, tmp_path: Path) -> None:
    path = tmp_path / "dyn.onnx"
    onnx.save(conv_with_runtime_weight(), path)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "calib.npz", x=rng.standard_normal((4, 3, 8, 8)).astype(np.float32),
             w_flat=rng.standard_normal((4, 144)).astype(np.float32) * 0.2)
    result = run_cli("quantize", path, "--calib", tmp_path / "calib.npz", "-o", tmp_path / "o.onnx")
    assert result.exit_code == 0, result.output
    assert "warning" in result.output and "conv_dynamic_weight" in result.output and "stays FP32" in result.output
    strict = run_cli("quantize", path, "--calib", tmp_path / "calib.npz", "-o", tmp_path / "s.onnx", "--strict")
    assert strict.exit_code == 1 and "UnsupportedOpError" in strict.output and "conv_dynamic_weight" in strict.output
    assert not (tmp_path / "s.onnx").exists()


def test_failed_export_leaves_no_file(run_cli: CliInvoke, model: Path, tmp_path: Path) -> None:
    out = tmp_path / "o.onnx"
    result = run_cli("quantize", model, "--calib", "random", "-o", out, "--opset", "12")
    assert result.exit_code == 1 and "ExportError" in result.output
    assert list(tmp_path.iterdir()) == [model]


def _float_weight_ops(path: Path) -> set[str]:
    """Conv / Gemm nodes whose weight is a plain float initializer (not DequantizeLinear output)."""
    nodes = onnx.load(str(path)).graph.node
    producers = {o: n for n in nodes for o in n.output}
    return {n.name for n in nodes if n.op_type in ("Conv", "Gemm") and n.input[1] not in producers}


def test_fp32_ops_keeps_selected_ops_in_float(run_cli: CliInvoke, model: Path, tmp_path: Path) -> None:
    base, forced = tmp_path / "base.onnx", tmp_path / "forced.onnx"
    assert run_cli("quantize", model, "--calib", "random", "-o", base, "-q").exit_code == 0
    assert {"conv2", "fc"} - _float_weight_ops(base) == {"conv2", "fc"}  # both quantized by default
    result = run_cli("quantize", model, "--calib", "random", "-o", forced, "--fp32-ops", "Gemm,name:conv2", "-q")
    assert result.exit_code == 0, result.output
    assert {"conv2", "fc"} <= _float_weight_ops(forced)


def test_console_script_entry_point() -> None:
    import shutil
    import subprocess

    exe = shutil.which("netquant")
    if exe is None:
        pytest.skip("netquant console script not installed in this environment")
    out = subprocess.run([exe, "platforms", "--names"], capture_output=True, text=True, check=True).stdout
    assert out.split() == list_platforms()


@pytest.mark.slow
def test_demo_quantizes_the_ppocr_recognizer(run_cli: CliInvoke) -> None:
    result = run_cli("demo", "--calib-lines", "128", "--eval-lines", "100", "--quiet")
    assert result.exit_code == 0, result.output
    assert "FP32" in result.output and "INT8 (netquant)" in result.output and "QLinearConv" in result.output
