"""netquant.atomic: whole-or-nothing writes with ordinary file permissions."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from netquant.atomic import atomic_path, write_bytes_atomic, write_text_atomic
from netquant.errors import DataError, ExportError


def test_written_file_has_umask_permissions_not_mkstemp_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        path = write_text_atomic(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert path.read_text() == "{}"


def test_failure_keeps_the_existing_file_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "model.onnx"
    target.write_bytes(b"old")
    with pytest.raises(ExportError, match="model.onnx.*no file written.*boom"), \
            atomic_path(target, "ONNX model") as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("boom")
    assert target.read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_missing_folder_names_it_with_the_chosen_error(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="folder .*missing.* does not exist"):
        write_bytes_atomic(tmp_path / "missing" / "x.safetensors", b"x", "safetensors file", DataError)
