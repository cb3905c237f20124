"""Placement files and placement settings a user can get wrong: each refused with a message naming the file and field
(issue 19: malformed files gave tracebacks, unknown decisions ran as int8, another CPU target was accepted)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from netquant.api import quantize_onnx
from netquant.errors import ConfigError
from tests.conftest import CliInvoke
from tests.helpers.onnx_models import calib_batches, conv_relu_gemm

BATCHES = calib_batches((2, 3, 8, 8), 2)


@pytest.fixture(scope="module")
def placement_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A valid placement file of conv_relu_gemm on onnxruntime_int8 (target 'any'); its regions run in int8."""
    qm = quantize_onnx(conv_relu_gemm(), BATCHES, quiet=True)
    path = qm.save_placement(tmp_path_factory.mktemp("placement") / "p.json")
    assert [r.decision for r in qm.placement.regions] == ["int8", "int8"]
    return path


def _edited(src: Path, tmp_path: Path, edit) -> Path:
    data = json.loads(src.read_text())
    edit(data)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(data))
    return out


def _apply(path: Path, **kw):
    return quantize_onnx(conv_relu_gemm(), BATCHES, quiet=True, placement_from=str(path), **kw)


def test_the_untouched_file_applies(placement_file: Path) -> None:
    qm = _apply(placement_file)
    assert [r.decision for r in qm.placement.regions] == ["int8", "int8"]


@pytest.mark.parametrize(("edit", "match"), [
    (lambda d: d.pop("regions"), r"missing field\(s\) regions"),
    (lambda d: d.update(model_sha256=123), r"field 'model_sha256' must be a string, got 123"),
    (lambda d: d.update(regions={"a": 1}), r"'regions' must be a list"),
    (lambda d: d["regions"][0].update(anchor=["conv"]), r"region 0: field 'anchor' must be a string"),
    (lambda d: d["regions"][1].update(decision="FLOAT"), r"region 1 \('.+'\): decision 'FLOAT' is not one of "
                                                        r"int8, wider, float"),
    (lambda d: d["regions"][0].update(decision="bogus"), r"decision 'bogus' is not one of"),
    (lambda d: d["regions"].__setitem__(0, "conv"), r"region 0: a region decision must be a JSON object"),
    (lambda d: d.update(max_loss=True), r"field 'max_loss' must be a number or null"),
], ids=["no_regions", "sha_int", "regions_dict", "anchor_list", "upper_case_float", "bogus", "region_str",
        "max_loss_bool"])
def test_malformed_placement_files_are_refused_naming_file_and_field(placement_file: Path, tmp_path: Path, edit,
                                                                      match: str) -> None:
    path = _edited(placement_file, tmp_path, edit)
    with pytest.raises(ConfigError, match=match) as info:
        _apply(path)
    assert str(path) in str(info.value)


def test_a_placement_file_for_another_cpu_target_is_refused(placement_file: Path, tmp_path: Path) -> None:
    assert json.loads(placement_file.read_text())["target"] == "any"
    with pytest.raises(ConfigError, match=r"measured for CPU target 'any', this run's target is 'x86-vnni' "
                                          r"\(--target\).*give --target any"):
        _apply(placement_file, target="x86-vnni")
    vnni = _edited(placement_file, tmp_path, lambda d: d.update(target="x86-vnni"))
    assert [r.decision for r in _apply(vnni, target="x86-vnni").placement.regions] == ["int8", "int8"]


@pytest.mark.parametrize("value", [math.nan, math.inf, True])
def test_max_loss_must_be_a_finite_number(value: float) -> None:
    with pytest.raises(ConfigError, match="max_loss .* must be None or a finite number >= 0"):
        quantize_onnx(conv_relu_gemm(), BATCHES, quiet=True, max_loss=value)


def test_max_loss_without_an_objective_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"max_loss \(--max-loss\) is the accuracy budget .* objective is None"):
        quantize_onnx(conv_relu_gemm(), BATCHES, quiet=True, objective=None, max_loss=0.01)
    with pytest.raises(ConfigError, match="metric / eval_data"):
        quantize_onnx(conv_relu_gemm(), BATCHES, quiet=True, objective=None, metric=lambda o, t: 0.0,
                      eval_data=[({"x": BATCHES[0]}, 0)])


@pytest.mark.parametrize(("args", "match"), [
    (("--max-loss", "nan"), "finite number"),
    (("--max-loss", "inf"), "finite number"),
    (("--max-loss", "0.01", "--objective", "none"), "--objective none"),
])
def test_cli_refuses_budgets_it_would_ignore_or_write_as_invalid_json(run_cli: CliInvoke, tmp_path: Path,
                                                                      args: tuple[str, ...], match: str) -> None:
    import numpy as np
    import onnx

    model, data = tmp_path / "m.onnx", tmp_path / "x.npy"
    onnx.save(conv_relu_gemm(), model)
    np.save(data, np.concatenate(BATCHES))
    out = tmp_path / "q.onnx"
    result = run_cli("quantize", model, "--calib", data, "-o", out, "--placement", tmp_path / "p.json", *args)
    assert result.exit_code == 1, result.output
    assert match in result.output and "Traceback" not in result.output
    assert not out.exists() and not (tmp_path / "p.json").exists()
