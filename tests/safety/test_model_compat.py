"""Models onnxruntime runs load, quantize and export in netquant (or are refused up front, clearly)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from click.testing import CliRunner

import netquant
from netquant.api.quantize import ModelCheckWarning
from netquant.cli.main import cli
from netquant.errors import ExportError, UnsupportedOpError
from netquant.graph.ops import register_op
from tests.helpers.safety_models import (
    conv_relu,
    custom_domain,
    dynamic_relu,
    fp16_matmul,
    images,
    ir3_opset7,
    ort_run,
)

CALIB = [images(1, seed=s) for s in range(8)]


def agreement(exported: Path, fp32: onnx.ModelProto) -> float:
    x = images(1, seed=99)
    (y,), (ref,) = ort_run(exported, {"x": x}), ort_run(fp32, {"x": x})
    return float(np.corrcoef(y.ravel(), ref.ravel())[0, 1])


def test_an_output_without_shape_quantizes_and_exports(tmp_path: Path) -> None:
    model = conv_relu(output_shape=False)
    with pytest.raises(onnx.checker.ValidationError, match="shape"):
        onnx.checker.check_model(model)  # onnx's checker refuses it, onnxruntime runs it
    with pytest.warns(ModelCheckWarning, match="onnx.checker reports .*shape"):
        qm = netquant.quantize_onnx(model, CALIB, quiet=True, allow_float=True)  # a warning at load, not a gate
    report = qm.export(tmp_path / "q.onnx")
    assert report.output_cosine["y"] > 0.98
    exported = onnx.load(tmp_path / "q.onnx")
    onnx.checker.check_model(exported)  # the export stays checked
    assert [d.dim_value for d in exported.graph.output[0].type.tensor_type.shape.dim] == [1, 4, 8, 8]
    assert agreement(tmp_path / "q.onnx", model) > 0.99


def test_ir3_opset7_model_exports_with_an_upgraded_ir(tmp_path: Path) -> None:
    model = ir3_opset7()
    qm = netquant.quantize_onnx(model, CALIB, quiet=True, allow_float=True)  # convs too small for int8: float
    report = qm.export(tmp_path / "q.onnx")
    exported = onnx.load(tmp_path / "q.onnx")
    assert report.source_opset == 7 and report.opset == 13
    assert exported.ir_version >= onnx.helper.find_min_ir_version_for(list(exported.opset_import))
    assert {i.name for i in exported.graph.input} == {"x"}
    assert agreement(tmp_path / "q.onnx", model) > 0.99


def test_fp16_model_is_refused_up_front_naming_what_is_fp16(tmp_path: Path) -> None:
    onnx.save(fp16_matmul(), tmp_path / "h.onnx")
    with pytest.raises(UnsupportedOpError, match=r"h.onnx.*float16.*input 'x', initializer 'w'.*FP32"):
        netquant.quantize_onnx(str(tmp_path / "h.onnx"), [np.ones((1, 4), np.float16)], quiet=True)
    result = CliRunner().invoke(cli, ["quantize", str(tmp_path / "h.onnx"), "--calib", "random",
                                      "-o", str(tmp_path / "q.onnx")])
    assert result.exit_code == 1 and "UnsupportedOpError" in result.output and ".tmp" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h.onnx"]


def test_custom_domain_op_export_names_the_users_file_and_node(tmp_path: Path) -> None:
    domain = "test.netquant.issue11"

    @register_op("Twice", domain=domain)
    def twice(inputs: list[torch.Tensor], attrs: dict, ctx: object) -> list[torch.Tensor]:
        return [inputs[0] * 2]

    model = custom_domain(domain)
    qm = netquant.quantize_onnx(model, CALIB, quiet=True, allow_float=True)
    y = qm.run({"x": torch.from_numpy(images(1, seed=3))}, fake_quant=False)["y"]
    (ref,) = ort_run(conv_relu(), {"x": images(1, seed=3)})
    np.testing.assert_allclose(y.numpy(), 2 * ref, rtol=1e-4, atol=1e-5)  # the executor runs the custom op
    with pytest.raises(ExportError) as err:
        qm.export(tmp_path / "q.onnx")
    message = str(err.value)
    assert "q.onnx" in message and "'custom_op'" in message and f"{domain}::Twice" in message
    assert "validate=False" in message and ".tmp" not in message
    assert list(tmp_path.iterdir()) == []
    qm.export(tmp_path / "q.onnx", validate=False, check_kernels=False)
    assert any(n.domain == domain for n in onnx.load(tmp_path / "q.onnx").graph.node)


def test_cli_validates_a_dynamic_model_with_its_own_calibration_batch(tmp_path: Path) -> None:
    onnx.save(dynamic_relu(), tmp_path / "d.onnx")
    data = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    np.save(tmp_path / "calib.npy", data)
    result = CliRunner().invoke(cli, ["quantize", str(tmp_path / "d.onnx"), "--calib", str(tmp_path / "calib.npy"),
                                      "-o", str(tmp_path / "q.onnx"), "-q", "--allow-float"])  # Relu only
    assert result.exit_code == 0, result.output
    (y,) = ort_run(tmp_path / "q.onnx", {"x": data})
    np.testing.assert_array_equal(y, np.maximum(data, 0))
