"""Every quantized module: exact torch behaviour in pass-through, hand-computed fake-quant when quantizing.

References are built from PyTorch's own fake-quant kernels (torch.fake_quantize_per_tensor_affine /
per_channel_affine) and the float torch module run on the fake-quantized tensors.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import netquant.nn as nqnn
from netquant.core.spec import QuantSpec
from netquant.nn.rules import LayerQuantConfig, QuantizerConfig
from tests.helpers.ranges import amax_out, round_out

INT8_FULL = (-128, 127)
INT8_NARROW = (-127, 127)
INT8_W = INT8_NARROW


def fq_tensor(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Hand reference for the default (TensorRT) int8 activations, symmetric narrow per-tensor min-max:
    s = amax' / 127 (half of qmax - qmin = 254), z = 0, codes in [-127, 127]; amax' = max|x| rounded
    outward to 8 significant bits (the calibration range rule, tests.helpers.ranges)."""
    s = amax_out(x.abs().max()) / 127
    return torch.fake_quantize_per_tensor_affine(x, s, 0, *INT8_NARROW), s


def fq_tensor_full(x: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Hand reference for QuantSpec.int8() (full range [-128, 127]) min-max: s = amax' / 127.5, z = 0."""
    s = amax_out(x.abs().max()) / 127.5
    return torch.fake_quantize_per_tensor_affine(x, s, 0, *INT8_FULL), s


def fq_channel(w: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Hand reference for int8 symmetric narrow per-channel min-max: s_c = amax_c / 127."""
    amax = w.detach().abs().movedim(axis, 0).reshape(w.shape[axis], -1).max(dim=1).values
    s = (amax / 127.0).float()
    zp = torch.zeros(w.shape[axis], dtype=torch.int32)
    return torch.fake_quantize_per_channel_affine(w.detach(), s, zp, axis, *INT8_W), s


CASES: list[tuple[str, Callable[[], nn.Module], Callable[[], torch.Tensor], int | None]] = [
    ("linear", lambda: nn.Linear(6, 5), lambda: torch.randn(4, 6), 0),
    ("conv1d", lambda: nn.Conv1d(3, 4, 3, padding=1), lambda: torch.randn(2, 3, 10), 0),
    ("conv2d", lambda: nn.Conv2d(4, 6, 3, stride=2, groups=2), lambda: torch.randn(2, 4, 9, 9), 0),
    ("conv3d", lambda: nn.Conv3d(2, 4, 3), lambda: torch.randn(1, 2, 5, 5, 5), 0),
    ("convT1d", lambda: nn.ConvTranspose1d(3, 4, 3, stride=2), lambda: torch.randn(2, 3, 6), 1),
    ("convT2d", lambda: nn.ConvTranspose2d(4, 6, 3, stride=2, groups=2, output_padding=1),
     lambda: torch.randn(2, 4, 5, 5), 1),
    ("convT3d", lambda: nn.ConvTranspose3d(2, 3, 3), lambda: torch.randn(1, 2, 4, 4, 4), 1),
    ("avgpool1d", lambda: nn.AvgPool1d(2), lambda: torch.randn(2, 3, 8), None),
    ("avgpool2d", lambda: nn.AvgPool2d(3, stride=2, padding=1), lambda: torch.randn(2, 3, 8, 8), None),
    ("avgpool3d", lambda: nn.AvgPool3d(2), lambda: torch.randn(1, 2, 4, 4, 4), None),
    ("adaptive1d", lambda: nn.AdaptiveAvgPool1d(3), lambda: torch.randn(2, 3, 8), None),
    ("adaptive2d", lambda: nn.AdaptiveAvgPool2d((2, 3)), lambda: torch.randn(2, 3, 7, 8), None),
    ("adaptive3d", lambda: nn.AdaptiveAvgPool3d(2), lambda: torch.randn(1, 2, 5, 5, 5), None),
]


def _quantized(float_module: nn.Module, x: torch.Tensor) -> nn.Module:
    q = nqnn.quantize_model(float_module)
    with nqnn.calibrate(q):
        q(x)
    return q


@pytest.mark.parametrize("name,make,make_input,axis", CASES, ids=[c[0] for c in CASES])
def test_pass_through_is_exact(name, make, make_input, axis):
    torch.manual_seed(0)
    ref, x = make(), make_input()
    q = _quantized(copy.deepcopy(ref), x)
    assert type(q).__name__ == "Quant" + type(ref).__name__
    nqnn.set_quant_mode(q, "pass_through")
    assert torch.equal(q(x), ref(x))


@pytest.mark.parametrize("name,make,make_input,axis", CASES, ids=[c[0] for c in CASES])
def test_quantize_matches_hand_reference(name, make, make_input, axis):
    torch.manual_seed(0)
    ref, x = make(), make_input()
    q = _quantized(copy.deepcopy(ref), x)
    float_out = ref(x)
    x_fq, s_in = fq_tensor(x)
    assert q.input_quantizer.scale.item() == pytest.approx(s_in, rel=1e-6)
    if axis is not None:
        w_fq, s_w = fq_channel(ref.weight, axis)
        torch.testing.assert_close(q.weight_quantizer.scale, s_w, rtol=1e-6, atol=0)
        with torch.no_grad():
            ref.weight.copy_(w_fq)
    expected = ref(x_fq)
    got = q(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(got, float_out)  # it really quantized


def test_embedding_pass_through_and_reference():
    torch.manual_seed(0)
    ref = nn.Embedding(10, 6, padding_idx=0)
    idx = torch.tensor([[1, 2, 0], [9, 4, 4]])
    q = nqnn.quantize_model(ref)
    assert isinstance(q, nqnn.QuantEmbedding)
    w_fq, _ = fq_channel(ref.weight, 0)
    assert torch.equal(q(idx), F.embedding(idx, w_fq, padding_idx=0))  # weight-only: no calibration needed
    nqnn.set_quant_mode(q, "pass_through")
    assert torch.equal(q(idx), ref(idx))


@pytest.mark.parametrize("batch_first,bidirectional", [(True, False), (False, True)])
def test_lstm_pass_through_and_reference(batch_first, bidirectional):
    torch.manual_seed(0)
    ref = nn.LSTM(5, 7, num_layers=2, batch_first=batch_first, bidirectional=bidirectional)
    x = torch.randn(3, 4, 5)
    q = _quantized(copy.deepcopy(ref), x)
    assert isinstance(q, nqnn.QuantLSTM) and len(q.weight_quantizers) == (8 if bidirectional else 4)
    nqnn.set_quant_mode(q, "pass_through")
    out_q, (h_q, c_q) = q(x)
    out_r, (h_r, c_r) = ref(x)
    assert torch.equal(out_q, out_r) and torch.equal(h_q, h_r) and torch.equal(c_q, c_r)

    nqnn.set_quant_mode(q, "quantize")
    x_fq, _ = fq_tensor(x)
    with torch.no_grad():
        for name in q.weight_quantizers:
            getattr(ref, name).copy_(fq_channel(getattr(ref, name), 0)[0])
    out_q, (h_q, _) = q(x)
    out_r, (h_r, _) = ref(x_fq)
    torch.testing.assert_close(out_q, out_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(h_q, h_r, rtol=1e-5, atol=1e-6)
    # float weights are left in place after forward
    assert torch.equal(q.weight_ih_l0, q._flat_weights[0])


def test_direct_construction_matches_torch_module():
    torch.manual_seed(0)
    ql = nqnn.QuantLinear(6, 3)
    ref = nn.Linear(6, 3)
    ref.load_state_dict({k: v for k, v in ql.state_dict().items() if "quantizer" not in k})
    x = torch.randn(2, 6)
    assert torch.equal(ql(x), ref(x))  # no config: all quantizers pass through
    qc = nqnn.QuantConv2d(3, 4, 3, padding=1, bias=False)
    assert qc.bias is None and qc(torch.randn(1, 3, 5, 5)).shape == (1, 4, 5, 5)


def _site_config() -> LayerQuantConfig:
    return LayerQuantConfig(input=QuantizerConfig(QuantSpec.int8()))


def test_functional_sites_pass_through_and_reference():
    torch.manual_seed(0)
    a, b = torch.randn(3, 4), torch.randn(4, 5)
    add, mm, cat = nqnn.QuantAdd(), nqnn.QuantMatmul(), nqnn.QuantCat(dim=1)
    assert torch.equal(add(a, a * 2), a + a * 2)
    assert torch.equal(mm(a, b), a @ b)
    assert torch.equal(cat([a, a * 3]), torch.cat([a, a * 3], 1))

    class Sites(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.add, self.mm, self.cat = nqnn.QuantAdd(), nqnn.QuantMatmul(), nqnn.QuantCat(dim=1)

        def forward(self, a, b):
            return self.add(a, a * 2), self.mm(a, b), self.cat([a, a * 3])

    model = nqnn.quantize_model(Sites(), nqnn.ModelQuantConfig((nqnn.QuantRule(layer=_site_config()),)))
    with nqnn.calibrate(model):
        model(a, b)
    y_add, y_mm, y_cat = model(a, b)
    assert torch.equal(y_add, fq_tensor_full(a)[0] + fq_tensor_full(a * 2)[0])
    torch.testing.assert_close(y_mm, fq_tensor_full(a)[0] @ fq_tensor_full(b)[0])
    # cat shares one quantizer over both inputs: the scale comes from the larger one
    s = amax_out((a * 3).abs().max()) / 127.5
    shared = [torch.fake_quantize_per_tensor_affine(t, s, 0, -128, 127) for t in (a, a * 3)]
    assert torch.equal(y_cat, torch.cat(shared, 1))


def test_output_quantizer_and_affine_uint8():
    torch.manual_seed(0)
    layer = LayerQuantConfig(input=QuantizerConfig(QuantSpec.uint8_affine()),
                             output=QuantizerConfig(QuantSpec.uint8_affine()))
    cfg = nqnn.ModelQuantConfig((nqnn.QuantRule(layer=layer),))
    ref = nn.Linear(4, 3)
    x = torch.rand(8, 4) + 0.5  # strictly positive: the range is extended to include 0
    q = nqnn.quantize_model(ref, cfg)
    with nqnn.calibrate(q):
        q(x)
    s_in = round_out(float(x.max())) / 255  # range ends rounded outward to 8 bits, then [0, max]
    x_fq = torch.fake_quantize_per_tensor_affine(x, s_in, 0, 0, 255)
    y_float = ref(x).detach()  # calibration runs the model in float: the output range is the float one
    lo, hi = min(round_out(float(y_float.min())), 0.0), max(round_out(float(y_float.max())), 0.0)
    y = ref(x_fq)
    s_out = (hi - lo) / 255
    z_out = int(round(-lo / s_out))
    expected = torch.fake_quantize_per_tensor_affine(y, s_out, z_out, 0, 255)
    torch.testing.assert_close(q(x), expected, rtol=1e-5, atol=1e-6)


def test_w4_per_group_linear_matches_hand_reference():
    torch.manual_seed(0)
    ref = nn.Linear(32, 6)
    q = nqnn.quantize_model(ref, nqnn.ModelQuantConfig.w4a16(group_size=8))
    w = ref.weight.detach()
    groups = w.reshape(6 * 4, 8)  # (out * groups, group)
    s = groups.abs().amax(dim=1) / 7.5  # int4 symmetric full range [-8, 7]
    w_fq = torch.fake_quantize_per_channel_affine(groups, s, torch.zeros(24, dtype=torch.int32), 0, -8, 7)
    torch.testing.assert_close(q.weight_quantizer.scale, s.reshape(6, 4), rtol=1e-6, atol=0)
    x = torch.randn(3, 32)
    torch.testing.assert_close(q(x), nn.functional.linear(x, w_fq.reshape(6, 32), ref.bias), rtol=1e-5, atol=1e-6)


def test_fp8_conv_matches_hand_reference():
    torch.manual_seed(0)
    ref = nn.Conv2d(3, 4, 3)
    x = torch.randn(2, 3, 6, 6)
    q = nqnn.quantize_model(ref, nqnn.ModelQuantConfig.fp8())
    with nqnn.calibrate(q):
        q(x)

    def fp8(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return (t / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s

    s_x = amax_out(x.abs().max()) / 448
    s_w = ref.weight.detach().abs().amax(dim=(1, 2, 3)) / 448
    expected = nn.functional.conv2d(fp8(x, s_x), fp8(ref.weight.detach(), s_w.reshape(4, 1, 1, 1)), ref.bias)
    torch.testing.assert_close(q(x), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.filterwarnings("ignore:LSTM with projections:UserWarning")
def test_lstm_packed_sequence_and_projection():
    from torch.nn.utils.rnn import pack_padded_sequence

    torch.manual_seed(0)
    ref = nn.LSTM(4, 6, proj_size=3, batch_first=True)
    x = torch.randn(3, 5, 4)
    q = _quantized(copy.deepcopy(ref), x)
    assert "weight_hr_l0" in q.weight_quantizers
    packed = pack_padded_sequence(x, torch.tensor([5, 3, 2]), batch_first=True)
    nqnn.set_quant_mode(q, "pass_through")
    out_q, _ = q(packed)
    out_r, _ = ref(packed)
    assert torch.equal(out_q.data, out_r.data)
    nqnn.set_quant_mode(q, "quantize")
    out_q, _ = q(packed)
    assert out_q.data.shape == out_r.data.shape and not torch.equal(out_q.data, out_r.data)
    assert (out_q.data - out_r.data).abs().max() < 0.05
