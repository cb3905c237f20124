"""Fixtures shared by every test package: small ONNX model files, calibration batches and the CLI runner.

The models themselves live in `tests.helpers` (plain functions, usable outside fixtures too).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner, Result

from netquant.cli.main import cli
from tests.helpers.export_models import conv_net, images

CliInvoke = Callable[..., Result]


@pytest.fixture()
def run_cli() -> CliInvoke:
    """Invoke the `netquant` command with string-converted arguments; exceptions propagate."""
    runner = CliRunner()

    def invoke(*args: str | Path) -> Result:
        return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)

    return invoke


@pytest.fixture()
def conv_net_file(tmp_path: Path) -> Path:
    """`conv_net(batch=1)` (static input x[1, 3, 16, 16]) saved as tmp_path/net.onnx."""
    path = tmp_path / "net.onnx"
    onnx.save(conv_net(batch=1), path)
    return path


@pytest.fixture()
def calib_images() -> np.ndarray:
    """16 calibration images for conv_net, x[16, 3, 16, 16] float32 (seed 0)."""
    return images(16)


@pytest.fixture()
def calib_npy(tmp_path: Path, calib_images: np.ndarray) -> Path:
    """`calib_images` saved as tmp_path/calib.npy (the CLI's --calib file)."""
    path = tmp_path / "calib.npy"
    np.save(path, calib_images)
    return path
