"""LiteRT's C++ INFO lines stay out of netquant's output (issue 19: "INFO: Created TensorFlow Lite XNNPACK delegate
for CPU." appeared in every .tflite export), while its other stderr output is kept."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from netquant.export.tflite.validate import quiet_native_info
from tests.helpers.found_models import wide_conv

SRC = Path(__file__).resolve().parents[2] / "src"


def test_native_info_lines_are_dropped_and_the_rest_kept(capfd: pytest.CaptureFixture[str]) -> None:
    with quiet_native_info():
        os.write(2, b"INFO: Created TensorFlow Lite XNNPACK delegate for CPU.\nWARNING: kept\n")
    assert capfd.readouterr().err == "WARNING: kept\n"


def test_on_failure_every_captured_line_is_written_back(capfd: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(RuntimeError, match="boom"), quiet_native_info():
        os.write(2, b"INFO: context\nERROR: the real cause\n")
        raise RuntimeError("boom")
    assert capfd.readouterr().err == "INFO: context\nERROR: the real cause\n"
    os.write(2, b"after\n")  # fd 2 is the original again
    assert capfd.readouterr().err == "after\n"


@pytest.mark.skipif(importlib.util.find_spec("ai_edge_litert") is None, reason="needs ai-edge-litert")
def test_a_tflite_export_prints_no_xnnpack_line(tmp_path: Path) -> None:
    onnx.save(wide_conv(), tmp_path / "m.onnx")
    result = subprocess.run([sys.executable, "-m", "netquant.cli.main", "quantize", str(tmp_path / "m.onnx"),
                             "--calib", "random", "-o", str(tmp_path / "m.tflite"), "--platform", "tflite_int8",
                             "--objective", "none"], capture_output=True, text=True, timeout=300,
                            env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "m.tflite").exists() and "int8 kernels in LiteRT" in result.stdout
    assert "XNNPACK" not in result.stderr + result.stdout and "INFO:" not in result.stderr
