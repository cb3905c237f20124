"""`netquant` command line: quantize, platforms, and the bad-input cases."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from PIL import Image

from netquant.platforms import list_platforms
from tests.conftest import CliInvoke
from tests.helpers.export_models import conv_with_runtime_weight, images
from tests.helpers.exports import (
    json_record,
    read_params_json,
    read_trt_cache,
    round_outward,
    symmetric_int8_scale,
    torch_minmax_params,
)


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


def test_quantize_from_npy_writes_model_json_and_trt_cache(run_cli: CliInvoke, model: Path, tmp_path: Path,
                                                           calib_npy: Path, calib_images: np.ndarray) -> None:
    out = tmp_path / "out.onnx"
    result = run_cli("quantize", model, "--calib", calib_npy, "-o", out, "--json", tmp_path / "p.json",
                 "--trt-cache", tmp_path / "c.cache")
    assert result.exit_code == 0, result.output
    assert "QLinearConv x" in result.output and "ops quantized" in result.output
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    y = sess.run(None, {"x": images(1, seed=5)})[0]
    ref = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": images(1, seed=5)})[0]
    assert np.corrcoef(y.ravel(), ref.ravel())[0, 1] > 0.99
    params = read_params_json(tmp_path / "p.json")
    assert params["platform"] == "onnxruntime_int8"
    # conv1 stays float on onnxruntime (too few multiply-adds); conv2's input r1 is the first quantized one
    r1 = json_record(params, "conv2", "input:0")
    assert (r1["tensor"], r1["state"], r1["bits"], r1["quant_min"], r1["quant_max"]) == ("r1", "ACTIVATED", 8, 0, 255)
    # min/max observer on the .npy batches: torch.ao's uint8 params of r1's range in the FP32 model
    scale, zp = torch_minmax_params(_fp32_tensor(model, "r1", calib_images), torch.quint8)
    assert r1["zero_point"] == zp == 0 and r1["scale"] == pytest.approx(scale, rel=1e-6)
    header, scales = read_trt_cache(tmp_path / "c.cache")
    assert header == "TRT-8601-EntropyCalibration2"
    assert list(scales) == ["r1", "r2", "f"]
    assert scales["r1"] == pytest.approx(symmetric_int8_scale(scale, zp, 0, 255), rel=1e-6)
    for tensor, amax_over_127 in scales.items():  # each entry: the exported range's amax / 127
        rec = next(r for r in params["configs"] if r["tensor"] == tensor and r["state"] == "ACTIVATED")
        assert amax_over_127 == pytest.approx(max(map(abs, rec["range"])) / 127, rel=1e-6), tensor


def _fp32_tensor(path: Path, name: str, x: np.ndarray) -> np.ndarray:
    """Intermediate tensor `name` of the FP32 model, computed by onnxruntime one sample at a time."""
    model = onnx.load(str(path))
    model.graph.output.append(onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None))
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return np.concatenate([sess.run([name], {"x": x[i:i + 1]})[0] for i in range(len(x))])


MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def _image_folder(folder: Path) -> Path:
    """6 PNGs (20 x 20) whose R, G and B channels span different pixel ranges, so that the channel order
    and the per-channel mean / std move the input's min / max."""
    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        rgb = np.stack([rng.integers(0, 90, (20, 20)), rng.integers(60, 170, (20, 20)),
                        rng.integers(140, 256, (20, 20))], axis=-1).astype(np.uint8)
        Image.fromarray(rgb).save(folder / f"{i}.png")
    return folder


def _hand_calibration(folder: Path, mean: tuple[float, ...], std: tuple[float, ...], bgr: bool) -> np.ndarray:
    """PIL bilinear resize to the model's 16 x 16, optional RGB -> BGR, then (pixel / 255 - mean) / std."""
    out = []
    for path in sorted(folder.glob("*.png")):
        with Image.open(path) as im:
            pixels = np.asarray(im.convert("RGB").resize((16, 16), Image.BILINEAR), dtype=np.float64)
        if bgr:
            pixels = pixels[:, :, ::-1]
        out.append(((pixels / 255 - np.array(mean)) / np.array(std)).transpose(2, 0, 1))
    return np.stack(out).astype(np.float32)


@pytest.mark.parametrize(("options", "mean", "std", "bgr"), [
    ((), (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), False),
    (("--mean", ",".join(map(str, MEAN)), "--std", ",".join(map(str, STD))), MEAN, STD, False),
    (("--mean", ",".join(map(str, MEAN)), "--std", ",".join(map(str, STD)), "--channel-order", "bgr"),
     MEAN, STD, True),
], ids=["defaults", "mean_std", "mean_std_bgr"])
def test_image_options_shape_the_calibration_tensors(run_cli: CliInvoke, model: Path, tmp_path: Path,
                                                     options: tuple[str, ...], mean: tuple[float, ...],
                                                     std: tuple[float, ...], bgr: bool) -> None:
    folder = _image_folder(tmp_path / "imgs")
    out, params = tmp_path / "img.onnx", tmp_path / "p.json"
    # tflite_int8 quantizes the network input with a min/max int8 affine quantizer
    result = run_cli("quantize", model, "--calib", folder, "-o", out, "--json", params, "--platform", "tflite_int8",
                     *options, "--quiet")
    assert result.exit_code == 0, result.output
    assert out.exists() and result.output == ""
    calib = _hand_calibration(folder, mean, std, bgr)
    x = json_record(read_params_json(params), "conv1", "input:0")
    assert (x["tensor"], x["state"], x["quant_min"], x["quant_max"]) == ("x", "ACTIVATED", -128, 127)
    scale, zp = torch_minmax_params(calib, torch.qint8)
    assert x["zero_point"] == zp and x["scale"] == pytest.approx(scale, rel=1e-6)
    # the exported range is the rounded data range (holding 0), shifted by the zero point's rounding
    # (< half a step)
    lo, hi = x["range"]
    assert abs(lo - round_outward(min(float(calib.min()), 0.0))) <= scale / 2 + 1e-7
    assert abs(hi - round_outward(max(float(calib.max()), 0.0))) <= scale / 2 + 1e-7


def test_the_three_image_settings_expect_different_input_params(tmp_path: Path) -> None:
    """Guard for the test above: its three hand-computed expectations differ, so a CLI that ignored
    --mean/--std or --channel-order would fail it."""
    folder = _image_folder(tmp_path / "imgs")
    expected = {torch_minmax_params(_hand_calibration(folder, mean, std, bgr), torch.qint8)
                for mean, std, bgr in [((0.0,) * 3, (1.0,) * 3, False), (MEAN, STD, False), (MEAN, STD, True)]}
    assert len(expected) == 3


def test_quantize_from_random_calibration(run_cli: CliInvoke, model: Path, tmp_path: Path) -> None:
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
    result = run_cli("quantize", path, "--calib", tmp_path / "calib.npz", "-o", tmp_path / "o.onnx", "--allow-float")
    assert result.exit_code == 0, result.output  # nothing else to quantize: a float file, written as asked
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
    result = run_cli("quantize", model, "--calib", "random", "-o", forced, "--fp32-ops", "Gemm,name:conv2", "-q",
                     "--allow-float")  # the small first conv stays float by the platform's rules: nothing INT8
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


def test_tensorrt_writes_its_calibration_cache_and_says_the_file_was_checked_in_reference_semantics(
        run_cli: CliInvoke, model: Path, tmp_path: Path, calib_npy: Path) -> None:
    out = tmp_path / "trt.onnx"
    result = run_cli("quantize", model, "--platform", "tensorrt_int8", "--calib", calib_npy, "-o", out)
    assert result.exit_code == 0, result.output
    header, scales = read_trt_cache(tmp_path / "trt.cache")  # written without --trt-cache: TensorRT's input
    assert header.startswith("TRT-") and scales
    text = " ".join(result.output.replace("│", " ").split())  # the table's wrapped cells, read as one line
    assert "Q/DQ reference" in text and "reference semantics only" in text
    assert "int8 kernels in onnxruntime" not in text  # onnxruntime is not this file's engine
