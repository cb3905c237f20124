"""One output plan per run: outputs checked against each other and the inputs up front, written all or none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import netquant
from netquant.atomic import atomic_path
from netquant.cli.main import cli
from netquant.errors import ConfigError, ExportError
from netquant.outputs import OutputPlan
from tests.helpers.safety_models import images, ort_run


def quantize(*args: str | Path) -> object:
    return CliRunner().invoke(cli, ["quantize", *map(str, args)], catch_exceptions=False)


def files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize("side", ["--json", "--trt-cache"])  # --report needs .md / .png, -o a model suffix
def test_a_side_output_cannot_replace_the_model(model: Path, tmp_path: Path, side: str) -> None:
    out = tmp_path / "out"
    out.mkdir()
    target = out / "m.onnx"
    result = quantize(model, "--calib", "random", "-o", target, side, target)
    assert result.exit_code == 1
    assert "ConfigError" in result.output and "same file" in result.output and side in result.output
    assert files(out) == []


@pytest.mark.parametrize("option", ["-o", "--json", "--trt-cache"])
def test_the_input_model_is_never_overwritten(model: Path, tmp_path: Path, option: str) -> None:
    before = model.read_bytes()
    args = ["-o", tmp_path / "q.onnx"] if option != "-o" else []
    result = quantize(model, "--calib", "random", *args, option, model)
    assert result.exit_code == 1 and "is the input file" in result.output
    assert model.read_bytes() == before
    assert files(tmp_path) == ["m.onnx"]


def test_a_hard_link_to_the_input_is_the_input(model: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.onnx"
    os.link(model, link)
    result = quantize(model, "--calib", "random", "-o", link)
    assert result.exit_code == 1 and "is the input file" in result.output
    assert link.read_bytes() == model.read_bytes()


def test_the_calibration_file_is_an_input_too(model: Path, tmp_path: Path) -> None:
    calib = tmp_path / "calib.npy"
    np.save(calib, images(4))
    result = quantize(model, "--calib", calib, "-o", tmp_path / "q.onnx", "--json", calib)
    assert result.exit_code == 1 and "is the input file" in result.output
    np.testing.assert_array_equal(np.load(calib), images(4))


def test_a_missing_side_output_folder_fails_before_the_model_is_written(model: Path, tmp_path: Path) -> None:
    result = quantize(model, "--calib", "random", "-o", tmp_path / "q.onnx", "--json", tmp_path / "nodir" / "p.json")
    assert result.exit_code == 1 and "'nodir' does not exist" in result.output.replace(str(tmp_path) + "/", "")
    assert files(tmp_path) == ["m.onnx"]


def test_an_output_that_is_a_folder_is_refused(model: Path, tmp_path: Path) -> None:
    result = quantize(model, "--calib", "random", "-o", tmp_path)  # click refuses it as a usage error
    assert result.exit_code == 2 and "is a directory" in result.output
    (tmp_path / "d.json").mkdir()
    with pytest.raises(ConfigError, match="--json .*d.json' is a folder"):
        OutputPlan.create([("-o", tmp_path / "q.onnx", "model"), ("--json", tmp_path / "d.json", "json")])
    assert files(tmp_path) == ["d.json", "m.onnx"]


def test_an_unwritable_folder_is_a_netquant_error_from_cli_api_and_writer(model: Path) -> None:
    result = quantize(model, "--calib", "random", "-o", "/proc/x.onnx")
    assert result.exit_code == 1 and "ConfigError" in result.output and "/proc" in result.output
    qm = netquant.quantize_onnx(str(model), [images(1, s) for s in range(4)], quiet=True)
    with pytest.raises(ExportError, match="/proc"):
        qm.export("/proc/x.onnx")
    with pytest.raises(ExportError, match="no file can be created in folder '/proc'"), atomic_path("/proc/x.onnx"):
        pass


def test_api_export_refuses_to_overwrite_its_source(model: Path) -> None:
    qm = netquant.quantize_onnx(str(model), [images(1, s) for s in range(4)], quiet=True)
    before = model.read_bytes()
    with pytest.raises(ExportError, match="is the input file"):
        qm.export(model, format="json")
    assert model.read_bytes() == before


def test_all_outputs_are_written_together_and_agree_with_ort(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    np.save(tmp_path / "calib.npy", images(8))
    result = quantize(model, "--calib", tmp_path / "calib.npy", "-o", out / "q.onnx", "--json", out / "p.json",
                      "--trt-cache", out / "c.cache", "--report", out / "r.md", "--allow-float")  # convs too small
    assert result.exit_code == 0, result.output
    assert files(out) == ["c.cache", "p.json", "q.onnx", "r.md"]  # no staging files left
    x = images(1, seed=9)
    (y,), (ref,) = ort_run(out / "q.onnx", {"x": x}), ort_run(model, {"x": x})
    assert np.corrcoef(y.ravel(), ref.ravel())[0, 1] > 0.99


def test_a_failing_stage_writes_none_of_the_outputs(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("old")
    plan = OutputPlan.create([("-a", tmp_path / "a.txt", "a"), ("-b", tmp_path / "b.txt", "b")])
    with pytest.raises(ExportError, match="b.txt"), plan.staged() as stage:
        stage.write("-a", lambda p: p.write_text("new a"))
        stage.write("-b", lambda p: (_ for _ in ()).throw(ExportError(f"cannot write '{p}'")))
    assert files(tmp_path) == ["b.txt"] and (tmp_path / "b.txt").read_text() == "old"


def test_an_unwritten_planned_output_fails_the_commit(tmp_path: Path) -> None:
    plan = OutputPlan.create([("-a", tmp_path / "a.txt", "a"), ("-b", tmp_path / "b.txt", "b")])
    with pytest.raises(ExportError, match="-b were planned but not written"), plan.staged() as stage:
        stage.write("-a", lambda p: p.write_text("a"))
    assert files(tmp_path) == []


def test_two_spellings_of_one_path_conflict(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="same file"):
        OutputPlan.create([("-o", tmp_path / "a.onnx", "m"), ("--json", tmp_path / "x" / ".." / "a.onnx", "j")])


def test_sigterm_removes_the_temp_file_like_ctrl_c(tmp_path: Path) -> None:
    script = (
        "import os, signal, sys\n"
        "from netquant.atomic import atomic_path, terminate_cleanly\n"
        "with terminate_cleanly(), atomic_path(sys.argv[1]) as tmp:\n"
        "    tmp.write_bytes(b'x' * 300_000)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    raise SystemExit('not reached')\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m.onnx")], capture_output=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert files(tmp_path) == []
