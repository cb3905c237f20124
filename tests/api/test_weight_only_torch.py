"""The torch path writes real int4 storage: quantize_weights of a float module and export_weight_only of a
quantized one give MatMulNBits / blocked DQ files onnxruntime runs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import netquant
import netquant.nn as nqnn
from netquant.api.weight_only import export_weight_only
from netquant.errors import ConfigError, DataError


def _mlp(width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, width))


def _files_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + ".data")) if p.exists())


def _ops(path: Path) -> list[str]:
    return [n.op_type for n in onnx.load(path, load_external_data=False).graph.node]


def _run(path: Path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]


@pytest.mark.parametrize("fmt", ["matmulnbits", "dq"])
def test_quantize_weights_of_a_float_module(tmp_path: Path, fmt: str) -> None:
    model = _mlp(256)
    x = torch.randn(4, 3, 256)
    calib = [torch.randn(2, 3, 256) for _ in range(4)]
    out = tmp_path / "mlp_q4.onnx"
    result = netquant.quantize_weights(model, out, example_inputs=x, calib_data=calib, format=fmt, block_size=64,
                                       algorithm="gptq")
    assert len(result.layers) == 3 and result.path == out
    ops = _ops(out)
    assert ops.count("MatMulNBits" if fmt == "matmulnbits" else "DequantizeLinear") == 3, ops
    fp32 = sum(p.numel() * 4 for p in model.parameters())
    assert _files_bytes(out) < 0.2 * fp32
    assert [p.name for p in tmp_path.iterdir()] and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    with torch.no_grad():
        ref = model(x).numpy()
    got = _run(out, x)  # batch 4: dim 0 is dynamic
    cos = float((got * ref).sum() / np.linalg.norm(got) / np.linalg.norm(ref))
    assert cos > 0.99 and result.cosine and min(result.cosine.values()) > 0.99


def test_quantize_weights_of_a_module_needs_fitting_inputs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="example_inputs"):
        netquant.quantize_weights(_mlp(32), tmp_path / "m.onnx")
    with pytest.raises(DataError, match=r"calibration batch 0: input 'input_0' has shape \[2, 5, 32\]"):
        netquant.quantize_weights(_mlp(32), tmp_path / "m.onnx", example_inputs=torch.randn(2, 3, 32),
                                  calib_data=[torch.randn(2, 5, 32)], algorithm="awq")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("fmt", ["matmulnbits", "dq"])
def test_export_weight_only_of_a_w4a16_module(tmp_path: Path, fmt: str) -> None:
    model = _mlp(512)
    q = nqnn.quantize_model(model, nqnn.ModelQuantConfig.w4a16())
    x = torch.randn(3, 512)
    path = export_weight_only(q, x, tmp_path / f"w4a16_{fmt}.onnx", format=fmt)
    ops = _ops(path)
    if fmt == "matmulnbits":
        assert ops == ["MatMulNBits", "Relu", "MatMulNBits", "Relu", "MatMulNBits"], ops
    else:
        assert ops.count("DequantizeLinear") == 3 and "QuantizeLinear" not in ops
    fp32 = sum(p.numel() * 4 for p in model.parameters())
    assert path.stat().st_size < 0.16 * fp32
    with torch.no_grad():
        ref = q(x).numpy()
    if fmt == "matmulnbits":  # accuracy_level 0: float compute of the int4 weights
        np.testing.assert_allclose(_run(path, x), ref, rtol=1e-4, atol=1e-5)
    else:  # onnxruntime fuses DQ -> MatMul into MatMulNBits with int8 activations (its accuracy level 4)
        assert np.abs(_run(path, x) - ref).max() < 0.02 * np.abs(ref).max()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_export_weight_only_format_error_writes_nothing(tmp_path: Path) -> None:
    q = nqnn.quantize_model(_mlp(32), nqnn.ModelQuantConfig.w4a16(group_size=16))
    with pytest.raises(ConfigError, match="format='gguf': choose one of matmulnbits, dq"):
        export_weight_only(q, torch.randn(2, 32), tmp_path / "m.onnx", format="gguf")
    assert list(tmp_path.iterdir()) == []


def test_export_weight_only_int8_activation_kernel(tmp_path: Path) -> None:
    """accuracy_level 4: onnxruntime's integer MatMulNBits kernel (activations quantized to int8 per block)."""
    q = nqnn.quantize_model(_mlp(256), nqnn.ModelQuantConfig.w4a16(group_size=32))
    x = torch.randn(2, 4, 256)
    path = export_weight_only(q, x, tmp_path / "w4_acc4.onnx", accuracy_level=4)
    nodes = [n for n in onnx.load(path).graph.node if n.op_type == "MatMulNBits"]
    assert len(nodes) == 3 and all(a.i == 4 for n in nodes for a in n.attribute if a.name == "accuracy_level")
    with torch.no_grad():
        ref = q(x).numpy()
    err = np.abs(_run(path, x) - ref).max()
    assert 0 < err < 0.02 * np.abs(ref).max()
    with pytest.raises(ConfigError, match="accuracy_level=7"):
        export_weight_only(q, x, tmp_path / "bad.onnx", accuracy_level=7)
