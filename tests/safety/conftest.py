"""Fixtures of the safety tests."""

from __future__ import annotations

from pathlib import Path

import onnx
import pytest

from tests.helpers.safety_models import conv_relu


@pytest.fixture()
def model(tmp_path: Path) -> Path:
    """The conv-relu model saved as tmp_path / m.onnx."""
    path = tmp_path / "m.onnx"
    onnx.save(conv_relu(), path)
    return path
