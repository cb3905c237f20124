"""Dynamic quantization: int8 weights, activation params from each batch (vs hand reference and torch.ao)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.ao.quantization import quantize_dynamic as ao_quantize_dynamic

import netquant.nn as nqnn
from netquant.core.spec import QuantSpec
from netquant.errors import ExportError

# torch.ao (the reference) warns that it is deprecated; the comparison is the point
TORCH_AO_WARNINGS = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
                     pytest.mark.filterwarnings("ignore:.*quantized tensor creation.*:UserWarning")]


def _uint8_affine_reference(x: torch.Tensor) -> torch.Tensor:
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    s = (hi - lo) / 255
    z = int(min(max(round(-lo / s), 0), 255))
    return torch.fake_quantize_per_tensor_affine(x, s, z, 0, 255)


def test_dynamic_linear_uses_per_batch_params():
    torch.manual_seed(0)
    ref = nn.Linear(16, 8)
    q = nqnn.quantize_dynamic(nn.Sequential(ref))[0]
    assert isinstance(q, nqnn.QuantLinear) and q.input_quantizer.dynamic
    amax = ref.weight.detach().abs().amax(dim=1)
    w_fq = torch.fake_quantize_per_channel_affine(ref.weight.detach(), amax / 127, torch.zeros(8, dtype=torch.int32),
                                                  0, -127, 127)
    for scale in (1.0, 10.0):  # two batches with different ranges: different activation params
        x = torch.randn(5, 16) * scale
        torch.testing.assert_close(q(x), nn.functional.linear(_uint8_affine_reference(x), w_fq, ref.bias),
                                   rtol=1e-5, atol=1e-5)


@TORCH_AO_WARNINGS[0]
@TORCH_AO_WARNINGS[1]
def test_dynamic_linear_close_to_torch_ao():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    x = torch.randn(16, 32)
    cfg = nqnn.dynamic_config(weight_spec=QuantSpec.int8())  # per-tensor int8, as torch.ao's default
    ours = nqnn.quantize_dynamic(model, cfg)
    theirs = ao_quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)
    with torch.no_grad():
        ref, a, b = model(x), ours(x), theirs(x)
    err_ours, err_theirs = (a - ref).abs().max().item(), (b - ref).abs().max().item()
    assert (a - b).abs().max().item() < 0.02
    assert err_ours < 2 * err_theirs + 1e-3


@TORCH_AO_WARNINGS[0]
@TORCH_AO_WARNINGS[1]
def test_dynamic_lstm():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LSTM(6, 12, batch_first=True))
    x = torch.randn(3, 7, 6)
    q = nqnn.quantize_dynamic(model)
    assert isinstance(q[0], nqnn.QuantLSTM) and q[0].input_quantizer.dynamic
    with torch.no_grad():
        out_q, _ = q[0](x)
        out_f, _ = model[0](x)
        out_ao, _ = ao_quantize_dynamic(model, {nn.LSTM}, dtype=torch.qint8)[0](x)
    assert 0 < (out_q - out_f).abs().max().item() < 0.05
    assert (out_ao - out_f).abs().max().item() < 0.05


def test_dynamic_models_cannot_be_exported_as_static_qdq(tmp_path):
    q = nqnn.quantize_dynamic(nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ExportError, match="dynamic"):
        nqnn.export_onnx(q, torch.randn(2, 4), tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()
