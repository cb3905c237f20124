"""Calibration data that used to be accepted but wrong (issue 19): images beside .npy files, scalar inputs, a
grayscale model with the 3-value default mean / std, constant data."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
from PIL import Image

from netquant.api import quantize_onnx
from netquant.data import ImageOptions, load_calibration, model_inputs
from netquant.data.calib import split_batches
from netquant.errors import DataError
from netquant.passes.calib_data import ConstantDataWarning
from tests.helpers.found_models import gray_conv, scalar_gain, scalar_gain_reference


def _gray_images(folder: Path, n: int = 3) -> Path:
    folder.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    return folder


def test_a_folder_with_images_and_arrays_is_refused_naming_both(tmp_path: Path) -> None:
    folder = _gray_images(tmp_path / "mixed")
    np.save(folder / "extra.npy", np.zeros((1, 1, 16, 16), np.float32))
    onnx.save(gray_conv(), tmp_path / "m.onnx")
    with pytest.raises(DataError, match=r"holds both images \(3, e.g. '.*0.png'\) and arrays \(1 .npy/.npz, "
                                        r"e.g. '.*extra.npy'\).*separate folders"):
        load_calibration(folder, model_inputs(tmp_path / "m.onnx"))


def test_a_grayscale_model_takes_an_image_folder_with_the_default_mean_and_std(tmp_path: Path) -> None:
    folder = _gray_images(tmp_path / "imgs")
    onnx.save(gray_conv(), tmp_path / "m.onnx")
    data = load_calibration(folder, model_inputs(tmp_path / "m.onnx"), image_options=ImageOptions())
    with Image.open(folder / "0.png") as im:  # PIL's own grayscale conversion and bilinear resize, / 255
        first = np.asarray(im.convert("L").resize((16, 16), Image.BILINEAR), np.float32) / 255
    assert data["x"].shape == (3, 1, 16, 16)
    np.testing.assert_allclose(data["x"][0, 0], first, rtol=0, atol=1e-7)
    half = load_calibration(folder, model_inputs(tmp_path / "m.onnx"), image_options=ImageOptions(mean=(0.5,),
                                                                                                  std=(0.25,)))
    np.testing.assert_allclose(half["x"][0, 0], (first - 0.5) / 0.25, rtol=0, atol=1e-6)


def test_a_three_value_mean_for_a_grayscale_model_says_what_to_give(tmp_path: Path) -> None:
    folder = _gray_images(tmp_path / "imgs")
    onnx.save(gray_conv(), tmp_path / "m.onnx")
    opts = ImageOptions(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))
    with pytest.raises(DataError, match=r"give 3 values but input 'x' \[1, 1, 16, 16\].* takes grayscale images "
                                        r"\(1 channel\); give 1 value .*--mean 0.5 --std 0.5"):
        load_calibration(folder, model_inputs(tmp_path / "m.onnx"), image_options=opts)


def test_one_std_value_goes_with_a_per_channel_mean_and_zero_std_names_the_option() -> None:
    assert ImageOptions(mean=(0.4, 0.5, 0.6), std=(0.2,)).std == (0.2,)
    with pytest.raises(DataError, match=r"std \(--std\) 0 contains 0.*must be non-zero"):
        ImageOptions(std=(0.0,))
    with pytest.raises(DataError, match=r"mean \(--mean\) has 2 values but std \(--std\) has 3"):
        ImageOptions(mean=(0.1, 0.2), std=(1.0, 1.0, 1.0))


def test_scalar_inputs_calibrate_with_scalar_samples(tmp_path: Path) -> None:
    """Random data for a 0-d input gives 0-d samples (it gave shape [8]); .npy files of scalars load too; the
    quantized model runs them and matches numpy."""
    onnx.save(scalar_gain(), tmp_path / "m.onnx")
    inputs = model_inputs(tmp_path / "m.onnx")
    data = load_calibration("random", inputs, limit=5)
    batches = split_batches(data, inputs, 16)
    assert len(batches) == 5 and all(b["s"].shape == () and b["x"].shape == (1, 8) for b in batches)
    assert [float(b["s"]) for b in batches] == data["s"].tolist()
    np.save(tmp_path / "s.npy", np.float32(2.5))  # one 0-d sample
    folder = tmp_path / "npz"
    folder.mkdir()
    np.savez(folder / "a.npz", x=np.ones((1, 8), np.float32), s=np.float32(2.0))
    np.savez(folder / "b.npz", x=np.ones((1, 8), np.float32), s=np.array([3.0], np.float32))
    assert load_calibration(folder, inputs)["s"].tolist() == [2.0, 3.0]
    qm = quantize_onnx(str(tmp_path / "m.onnx"), batches, quiet=True, objective=None)
    qm.export(tmp_path / "q.onnx")
    import onnxruntime as ort

    sess = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"])
    x, s = batches[0]["x"], batches[0]["s"]
    out, ref = sess.run(None, {"x": x, "s": s})[0], scalar_gain_reference(x, s)
    cosine = float((out * ref).sum() / np.linalg.norm(out) / np.linalg.norm(ref))
    assert cosine > 0.99 and np.abs(out - ref).max() < 0.1 * np.abs(ref).max()


@pytest.mark.parametrize("value", [0.0, 0.7])
def test_constant_calibration_data_warns_naming_the_input(value: float) -> None:
    from tests.helpers.onnx_models import conv_relu_gemm

    batches = [np.full((2, 3, 8, 8), value, np.float32)] * 2
    with pytest.warns(ConstantDataWarning, match=f"calibration input 'x' is constant \\(every value is {value:g}\\)"):
        quantize_onnx(conv_relu_gemm(), batches, quiet=True, objective=None)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConstantDataWarning)  # real data: no warning
        quantize_onnx(conv_relu_gemm(), [np.random.default_rng(0).standard_normal((2, 3, 8, 8)).astype(np.float32)],
                      quiet=True, objective=None)


def test_constant_data_warns_once_for_a_stream() -> None:
    from tests.helpers.onnx_models import conv_relu_gemm

    stream = (np.zeros((2, 3, 8, 8), np.float32) for _ in range(2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quantize_onnx(conv_relu_gemm(), stream, quiet=True, objective=None)
    assert sum(isinstance(w.message, ConstantDataWarning) for w in caught) == 1


def test_cli_grayscale_model_with_an_image_folder_and_scalar_model_with_random_data(run_cli, tmp_path: Path) -> None:
    """The CLI's default --mean / --std (one value) fit a 1-channel model; --calib random fits a 0-d input."""
    folder = _gray_images(tmp_path / "imgs", n=4)
    onnx.save(gray_conv(), tmp_path / "gray.onnx")
    # (onnxruntime keeps these tiny models float: --allow-float, this test is about the calibration data)
    result = run_cli("quantize", tmp_path / "gray.onnx", "--calib", folder, "-o", tmp_path / "gray_q.onnx", "-q",
                     "--allow-float")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "gray_q.onnx").exists()
    onnx.save(scalar_gain(), tmp_path / "s.onnx")
    result = run_cli("quantize", tmp_path / "s.onnx", "--calib", "random", "-o", tmp_path / "s_q.onnx", "-q",
                     "--allow-float")
    assert result.exit_code == 0, result.output
    assert [i.name for i in onnx.load(tmp_path / "s_q.onnx").graph.input] == ["x", "s"]


def test_python_api_image_folder_for_a_grayscale_model(tmp_path: Path) -> None:
    """quantize_onnx(calib_data=folder) takes the same one-value defaults (and a plain number) as the CLI."""
    from netquant.data.calib import load_path_calibration

    folder = _gray_images(tmp_path / "imgs", n=4)
    onnx.save(gray_conv(), tmp_path / "m.onnx")
    batches = load_path_calibration(folder, model_inputs(tmp_path / "m.onnx"), 16, mean=0.5, std=0.25)
    with Image.open(folder / "0.png") as im:
        first = np.asarray(im.convert("L").resize((16, 16), Image.BILINEAR), np.float32) / 255
    assert len(batches) == 4 and batches[0]["x"].shape == (1, 1, 16, 16)
    np.testing.assert_allclose(batches[0]["x"][0, 0], (first - 0.5) / 0.25, rtol=0, atol=1e-6)
    for options in ({}, {"mean": 0.5, "std": 0.25}):  # (the small conv is int8 on LiteRT; onnxruntime keeps it float)
        qm = quantize_onnx(gray_conv(), str(folder), "tflite_int8", quiet=True, objective=None, **options)
        assert qm.summary()["quantized_ops"] >= 1
