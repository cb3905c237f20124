"""api.float_result: a model file with no INT8 region (or below min_int8_fraction) is refused with the measured
trade-off unless the user asks for it (allow_float, objective='latency'); the summary says why regions stay float."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from netquant.api import quantize_onnx
from netquant.api.float_result import float_words
from netquant.errors import ConfigError, ExportError, FloatResultError
from tests.conftest import CliInvoke
from tests.helpers.float_models import depthwise_batches, depthwise_stack


def _q(**kw):
    kw.setdefault("placement_time_s", 30.0)
    return quantize_onnx(depthwise_stack(), depthwise_batches(), quiet=True, **kw)


@pytest.fixture(scope="module")
def floated():
    """max_loss=0: every region must stay float (measured placement, once for the module)."""
    return _q(objective="accuracy", max_loss=0.0)


@pytest.fixture(scope="module")
def float_placement(floated, tmp_path_factory) -> Path:
    return floated.save_placement(tmp_path_factory.mktemp("placement") / "p.json")


def test_an_all_float_file_is_refused_with_the_measured_trade_off(floated, tmp_path):
    """The error names the share, the reasons by kind of op, the all-INT8 loss and speed, the placed and all-float
    times, and the options; no file is written."""
    with pytest.raises(FloatResultError) as err:
        floated.export(tmp_path / "f.onnx")
    text = str(err.value)
    assert isinstance(err.value, ExportError)
    assert "0 of 5 regions run in INT8" in text and str(tmp_path / "f.onnx") in text
    assert "depthwise Conv" in text and "all INT8: loss " in text and "all float: " in text
    assert "placed (this result): loss 0 " in text
    assert "--allow-float" in text and "No file written" in text
    assert not (tmp_path / "f.onnx").exists()


def test_allow_float_writes_it_and_the_summary_says_float_and_why(floated, tmp_path):
    s = floated.summary()
    assert s["int8_regions"] == {"int8": 0, "total": 5, "fraction": 0.0, "float_file": True}
    by_kind: dict[str, int] = {}
    for g in s["float_reasons"]:
        by_kind[g["kind"]] = by_kind.get(g["kind"], 0) + g["regions"]
    assert by_kind == {"depthwise Conv": 2, "Conv": 3}
    assert all(g["reason"] in ("over the accuracy budget", "slower in int8 here") for g in s["float_reasons"])
    assert "depthwise Conv" in float_words(floated.float_groups())
    report = floated.export(tmp_path / "f.onnx", allow_float=True)
    line = report.vs_fp32.line(float_file=True)
    assert line.startswith("float file vs FP32 in onnxruntime") and "graph clean-up alone" in line
    assert floated.summary()["vs_fp32"][-1]["engine"] == "onnxruntime"
    # the float file computes the source model, in onnxruntime
    x = depthwise_batches(1, seed=9)[0]
    src = ort.InferenceSession(depthwise_stack().SerializeToString(), providers=["CPUExecutionProvider"])
    got = ort.InferenceSession(str(tmp_path / "f.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, src.run(None, {"x": x})[0], rtol=1e-4, atol=1e-5)
    assert report.vs_fp32.outputs[0].cosine > 0.999999


def test_latency_objective_accepts_a_float_result_and_other_objectives_refuse_it(float_placement, tmp_path):
    with pytest.raises(FloatResultError, match="0 of 5 regions"):
        _q(placement_from=str(float_placement)).export(tmp_path / "a.onnx")
    lat = _q(placement_from=str(float_placement), objective="latency")
    lat.export(tmp_path / "b.onnx")
    assert lat.summary()["int8_regions"]["float_file"] is True
    allowed = _q(placement_from=str(float_placement), allow_float=True)
    assert allowed.export(tmp_path / "c.onnx").vs_fp32 is not None


def test_min_int8_fraction_sets_the_share_required(float_placement, tmp_path):
    """A placement file with 2 of 5 regions float: 0.6 INT8; refused at min_int8_fraction 0.7, accepted at 0.6 and by
    default (some region is INT8)."""
    data = json.loads(float_placement.read_text())
    for r in data["regions"][:3]:
        r["decision"] = "int8"
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(data))
    with pytest.raises(FloatResultError, match=r"3 of 5 regions run in INT8 \(minimum share 0.7\)"):
        _q(placement_from=str(path), min_int8_fraction=0.7).export(tmp_path / "a.onnx")
    assert _q(placement_from=str(path), min_int8_fraction=0.6).export(tmp_path / "b.onnx").validated
    qm = _q(placement_from=str(path))
    assert qm.int8_share().int8 == 3 and qm.int8_share().fraction == pytest.approx(0.6)
    with pytest.raises(ConfigError, match="min_int8_fraction"):
        _q(min_int8_fraction=1.5)


def test_a_model_with_nothing_quantized_is_a_float_result(tmp_path):
    """Every op kept float by force_fp32: no region at all, refused unless allowed."""
    qm = _q(objective=None, force_fp32=("Conv", "Relu"))
    with pytest.raises(FloatResultError, match="no op of the model is quantized"):
        qm.export(tmp_path / "a.onnx")
    assert _q(objective=None, force_fp32=("Conv", "Relu"), allow_float=True).int8_share().total == 0
    qm.export(tmp_path / "a.json", format="json")  # the quant-params JSON is no model file


# ---- the CLI ------------------------------------------------------------------------------------------------

def _flat(output: str) -> str:
    """The CLI's summary table as one line of words (rich wraps cells at the terminal width)."""
    return " ".join(re.sub("[│┃┌┐└┘├┤─┬┴┼━]", " ", output).split())


def _cli_inputs(tmp_path: Path) -> tuple[Path, Path]:
    model, calib = tmp_path / "dw.onnx", tmp_path / "calib.npy"
    onnx.save(depthwise_stack(), model)
    np.save(calib, np.concatenate(depthwise_batches()))
    return model, calib


def test_cli_refuses_a_float_file_unless_allowed_or_latency(run_cli: CliInvoke, float_placement, tmp_path):
    model, calib = _cli_inputs(tmp_path)
    out = tmp_path / "dw_int8.onnx"
    common = ("quantize", model, "--calib", calib, "-o", out, "--batch-size", "4", "--placement-from", float_placement)
    refused = run_cli(*common)
    assert refused.exit_code == 1 and not out.exists()
    assert "FloatResultError" in refused.output and "0 of 5 regions run in INT8" in refused.output
    assert "--allow-float" in refused.output
    allowed = run_cli(*common, "--allow-float")
    assert allowed.exit_code == 0, allowed.output
    text = _flat(allowed.output)
    assert out.exists() and "0 of 5 regions in INT8: the file runs in float" in text
    assert "float file vs FP32 in onnxruntime: cosine 1.00000" in text and "graph clean-up alone" in text
    out.unlink()
    latency = run_cli(*common, "--objective", "latency")
    assert latency.exit_code == 0, latency.output
    assert "0 of 5 regions in INT8: the file runs in float" in _flat(latency.output)
    strict = run_cli(*common, "--allow-float", "--min-int8-fraction", "2")
    assert strict.exit_code == 2  # click's range check


@pytest.mark.slow
def test_mobilenet_v2_ships_int8_or_is_refused_with_its_reasons(tmp_path):
    """The issue's journey: MobileNetV2 (torchvision's layout, 53 regions, random weights) with the defaults. Whatever
    placement decides on this CPU, a file with no INT8 region is refused with the reasons by kind (depthwise Conv
    among them) and written with allow_float; otherwise it is written and compared with FP32."""
    import torch

    from netquant.api import quantize_torch
    from tests.helpers.float_models import mobilenet_v2

    rng = np.random.default_rng(0)
    calib = [rng.standard_normal((8, 3, 96, 96)).astype(np.float32) for _ in range(2)]
    qm = quantize_torch(mobilenet_v2(width=0.5), torch.from_numpy(calib[0][:1]), calib, quiet=True,
                        dynamic_axes={"input_0": {0: "N"}})
    share = qm.int8_share()
    assert share.total == 53
    if share.int8 == 0:
        with pytest.raises(FloatResultError, match="0 of 53 regions") as err:
            qm.export(tmp_path / "m.onnx")
        assert "all INT8: loss" in str(err.value)
        assert any(g.kind == "depthwise Conv" for g in qm.float_groups())
        report = qm.export(tmp_path / "m.onnx", allow_float=True)
    else:
        report = qm.export(tmp_path / "m.onnx")
    assert report.vs_fp32.outputs[0].top1_agreement is not None and report.vs_fp32.outputs[0].cosine > 0.9
