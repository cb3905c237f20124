"""Tensors of tiny magnitude keep their int8 levels (the scale floor is relative to the tensor), and an export
whose engine output is all zero while FP32's is not is refused, naming the output, whatever it agrees with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx.numpy_helper
import pytest
import torch
from click.testing import CliRunner

import netquant
from netquant.cli.main import cli
from netquant.core.qparams import QParams
from netquant.errors import ExportError
from netquant.export.validate import agreement_of, refuse_zero_outputs
from tests.helpers.safety_models import conv_gemm, ort_run


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a64 @ b64 / (np.linalg.norm(a64) * np.linalg.norm(b64)))


def batches(scale: float, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((1, 8, 16, 16)) * scale).astype(np.float32) for _ in range(n)]


@pytest.mark.parametrize(("x_scale", "w_scale"), [(1e-8, 1.0), (1e-6, 1.0), (1.0, 1e-6), (1.0, 1e-8), (1e-6, 1e-6)])
def test_tiny_inputs_or_weights_quantize_to_int8_that_matches_fp32_in_onnxruntime(
        tmp_path: Path, x_scale: float, w_scale: float) -> None:
    model = conv_gemm(w_scale)
    qm = netquant.quantize_onnx(model, batches(x_scale, 8, 0), quiet=True, objective=None)
    assert len(qm.quantized_ops()) >= 3  # both Convs and the Gemm run in int8
    qm.export(tmp_path / "q.onnx")
    held_out = batches(x_scale, 4, 1)
    got = np.concatenate([ort_run(tmp_path / "q.onnx", {"x": x})[0] for x in held_out])
    ref = np.concatenate([ort_run(model, {"x": x})[0] for x in held_out])
    assert np.abs(ref).max() > 0 and np.abs(got).max() > 0
    assert cosine(got, ref) > 0.99


def test_cli_objective_none_on_tiny_calibration_data_writes_a_working_file(tmp_path: Path) -> None:
    model = tmp_path / "m.onnx"
    onnx.save(conv_gemm(), model)
    np.save(tmp_path / "calib.npy", np.concatenate(batches(1e-8, 8, 0)))
    result = CliRunner().invoke(cli, ["quantize", str(model), "--calib", str(tmp_path / "calib.npy"), "-o",
                                      str(tmp_path / "q.onnx"), "--objective", "none", "-q"])
    assert result.exit_code == 0, result.output
    x = batches(1e-8, 1, 2)[0]
    assert cosine(ort_run(tmp_path / "q.onnx", {"x": x})[0], ort_run(model, {"x": x})[0]) > 0.99


def test_an_all_zero_engine_output_is_refused_naming_the_output(tmp_path: Path) -> None:
    model = conv_gemm()
    qm = netquant.quantize_onnx(model, batches(1.0, 4, 0), quiet=True, objective=None)
    for cfg in qm.qgraph.configs():  # a scale far above the data: every input value codes as 0
        if cfg.name == "x" and cfg.params is not None:
            cfg.params = QParams(scale=torch.tensor(1e30), zero_point=cfg.params.zero_point)
    with pytest.raises(ExportError, match=r"output 'y' .*is all zero in onnxruntime while the FP32"):
        qm.export(tmp_path / "q.onnx")
    assert not (tmp_path / "q.onnx").exists()


def test_zero_output_rule_on_hand_vectors() -> None:
    fp32 = np.array([1e-6, -2e-6, 0.0], np.float32)
    zero = np.zeros(3, np.float32)
    a = agreement_of(zero, zero, fp32)  # engine and fake-quant both zero: cosine 1 with each other
    assert a.ort_vs_fake_quant == 1.0 and a.zero_output and not a.accepted(0.99, None)
    assert not a.accepted(0.99, 1.5)
    with pytest.raises(ExportError, match="output 'logits' \\(max \\|FP32\\| 2e-06\\) is all zero in LiteRT"):
        refuse_zero_outputs({"logits": a}, "m.onnx", "LiteRT")
    both_zero = agreement_of(zero, zero, zero)  # FP32 zero too: nothing lost
    denormal = agreement_of(zero, zero, np.full(3, 1e-42, np.float32))  # below float32's normal range
    assert not both_zero.zero_output and not denormal.zero_output
    refuse_zero_outputs({"y": both_zero, "z": denormal}, "m.onnx", "ncnn")


def test_a_bias_whose_int32_scale_underflows_stays_float(tmp_path: Path) -> None:
    model = conv_gemm(1e-20)
    model.graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(16, np.float32), "b1"))
    model.graph.node[0].input.append("b1")
    with pytest.warns(UserWarning, match="bias 'b1' of Conv 'conv1' stays float"):
        qm = netquant.quantize_onnx(model, batches(1e-30, 4, 0), quiet=True, objective=None)
    qm.export(tmp_path / "q.onnx")  # before: DataError "scale must be finite and > 0" (s_in * s_w = 0 in float32)
    x = batches(1e-30, 1, 1)[0]
    np.testing.assert_array_equal(ort_run(tmp_path / "q.onnx", {"x": x})[0], ort_run(model, {"x": x})[0])
