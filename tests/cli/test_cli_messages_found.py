"""Messages that blamed the wrong thing (issue 19): a full disk while writing OpenVINO IR blamed the model, ncnn's
named a hidden staging file; NaN and empty weights, an impossible --opset after calibration, --std 0."""

from __future__ import annotations

import importlib.util
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

from tests.conftest import CliInvoke
from tests.helpers.found_models import gray_conv, wide_conv


@pytest.fixture()
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 12 kB tmpfs (mounting needs root; skipped elsewhere)."""
    folder = tmp_path / "full"
    folder.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=12k", "tmpfs", str(folder)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield folder
    finally:
        subprocess.run(["umount", str(folder)], check=True)


def _quantize_into(run_cli: CliInvoke, tmp_path: Path, out: Path, *args: str) -> str:
    onnx.save(wide_conv(), tmp_path / "m.onnx")
    result = run_cli("quantize", tmp_path / "m.onnx", "--calib", "random", "-o", out, "-q", "--objective", "none",
                     *args)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and list(out.parent.iterdir()) == []
    return result.output


@pytest.mark.skipif(importlib.util.find_spec("openvino") is None, reason="needs openvino")
def test_a_full_disk_while_writing_openvino_ir_names_the_folder_not_the_model(run_cli: CliInvoke, tmp_path: Path,
                                                                             full_disk: Path) -> None:
    out = _quantize_into(run_cli, tmp_path, full_disk / "m.xml")
    assert f"writing OpenVINO IR '{full_disk / 'm.xml'}' (.xml + .bin) into folder '{full_disk}' failed" in out
    assert "kB free there" in out and "the model converted fine" in out
    assert "OpenVINO failed on the exported model" not in out


@pytest.mark.skipif(importlib.util.find_spec("ncnn") is None or importlib.util.find_spec("pnnx") is None,
                    reason="needs ncnn and pnnx")
def test_a_full_disk_while_writing_ncnn_names_the_real_file(run_cli: CliInvoke, tmp_path: Path,
                                                            full_disk: Path) -> None:
    out = _quantize_into(run_cli, tmp_path, full_disk / "m.param")
    assert "No space left on device" in out and ".stage." not in out
    assert f"'{full_disk}/m." in out


@pytest.mark.parametrize(("case", "message"), [
    ("nan", r"initializer 'w' \(read by 'conv' \(Conv\)\) holds 1 NaN value\(s\) of 36: NaN weights cannot be "
            r"quantized"),
    ("empty", r"initializer 'w' \(read by 'conv' \(Conv\)\) is an empty weight \(shape \[0, 1, 3, 3\]\)"),
])
def test_nan_and_empty_weights_are_model_errors_naming_the_weight(run_cli: CliInvoke, tmp_path: Path, case: str,
                                                                 message: str) -> None:
    import re

    model = gray_conv()
    w = model.graph.initializer[0]
    arr = onnx.numpy_helper.to_array(w).copy()
    arr = np.zeros((0, 1, 3, 3), np.float32) if case == "empty" else arr
    if case == "nan":
        arr[1, 0, 0, 0] = np.nan
    else:
        model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 0
    w.CopyFrom(onnx.numpy_helper.from_array(arr, "w"))
    onnx.save(model, tmp_path / "m.onnx")
    result = run_cli("quantize", tmp_path / "m.onnx", "--calib", "random", "-o", tmp_path / "q.onnx", "-q")
    assert result.exit_code == 1 and "ModelError" in result.output, result.output
    assert re.search(message, result.output), result.output
    assert "ignore_nonfinite" not in result.output


@pytest.mark.parametrize("opset", ["30", "9"])
def test_an_impossible_opset_is_refused_before_calibration(run_cli: CliInvoke, tmp_path: Path, opset: str) -> None:
    onnx.save(gray_conv(), tmp_path / "m.onnx")
    result = run_cli("quantize", tmp_path / "m.onnx", "--calib", "random", "-o", tmp_path / "q.onnx", "--opset", opset)
    assert result.exit_code == 1
    newest = onnx.defs.onnx_opset_version()
    assert f"--opset {opset} is out of range" in result.output and f"give one in 10..{newest}" in result.output
    assert "calibrat" not in result.output.lower()  # nothing ran before the refusal (no progress, no warning)


def test_std_zero_names_the_option(run_cli: CliInvoke, tmp_path: Path) -> None:
    from PIL import Image

    onnx.save(gray_conv(), tmp_path / "m.onnx")
    (tmp_path / "imgs").mkdir()
    Image.fromarray(np.full((16, 16), 100, np.uint8)).save(tmp_path / "imgs" / "a.png")
    result = run_cli("quantize", tmp_path / "m.onnx", "--calib", tmp_path / "imgs", "-o", tmp_path / "q.onnx",
                     "--std", "0")
    assert result.exit_code == 1
    assert "std (--std) 0 contains 0" in result.output and "mean has" not in result.output
