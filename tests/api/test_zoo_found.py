"""A shared model cache (NETQUANT_CACHE) used by several users (issue 19: the extracted PP-OCR folder kept mkdtemp's
0700 mode, and another user then got a raw OSError traceback)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import onnx
import pytest

from netquant.api import zoo
from netquant.errors import ConfigError


def _wheel() -> Path:
    """The rapidocr wheel from the real cache (fetched there by the PP-OCR tests); nothing is downloaded here."""
    zoo.ppocr_model_path("rec")
    found = sorted((zoo.cache_dir() / "wheels").glob("rapidocr_onnxruntime-1.4.4-*.whl"))
    if not found:
        pytest.skip("the rapidocr wheel is not in the model cache")
    return found[0]


def test_the_extracted_models_are_readable_by_other_users(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    wheel = _wheel()
    (tmp_path / "wheels").mkdir()
    shutil.copy(wheel, tmp_path / "wheels" / wheel.name)
    monkeypatch.setenv("NETQUANT_CACHE", str(tmp_path))
    old = os.umask(0o022)
    try:
        path = zoo.ppocr_model_path("rec")
    finally:
        os.umask(old)
    assert path.parent == tmp_path / "rapidocr-1.4.4"
    assert path.parent.stat().st_mode & 0o777 == 0o755  # (mkdtemp's 0o700 before)
    assert path.stat().st_mode & 0o777 == 0o644
    assert onnx.load(str(path), load_external_data=False).graph.node  # the real model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rapidocr-1.4.4", "wheels"]  # no temp folder left


def test_a_cache_folder_this_user_cannot_read_is_a_config_error(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder another user made (0700, theirs): os.access says no for this user; the tests run as root, who may
    read anything, so the answer of os.access is given for that folder alone."""
    target = tmp_path / "rapidocr-1.4.4"
    target.mkdir(mode=0o700)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if Path(p) == target else real_access(p, mode, **kw))
    monkeypatch.setenv("NETQUANT_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=r"the model cache folder '.*rapidocr-1.4.4' exists but this user cannot "
                                          r"read it .*set NETQUANT_CACHE to a folder of your own"):
        zoo.ppocr_model_path("rec")
