"""Min-max family against torch.ao's observers (same scale and zero point), hist_l2 against
torch.ao HistogramObserver (scale within 1 %)."""

from __future__ import annotations

import pytest
import torch
from torch.ao.quantization import observer as ao

from netquant.calib import make_observer
from netquant.core.spec import Granularity, QuantSpec

SCHEMES = [
    (torch.qint8, torch.per_tensor_symmetric, QuantSpec(bits=8, signed=True, symmetric=True)),
    (torch.qint8, torch.per_tensor_affine, QuantSpec(bits=8, signed=True, symmetric=False)),
    (torch.quint8, torch.per_tensor_symmetric, QuantSpec(bits=8, signed=False, symmetric=True)),
    (torch.quint8, torch.per_tensor_affine, QuantSpec(bits=8, signed=False, symmetric=False)),
]
PER_CHANNEL = {torch.per_tensor_symmetric: torch.per_channel_symmetric,
               torch.per_tensor_affine: torch.per_channel_affine}


def _batches(seed: int, shape: tuple[int, ...], count: int = 5) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(count):
        x = torch.randn(shape, generator=g) * (0.5 + i * 0.3) + (i - 2) * 0.2
        out.append(x)
    return out


def _assert_same(ours, scale, zero_point):
    assert torch.equal(ours.scale.reshape(-1), scale.reshape(-1).float())
    assert torch.equal(ours.zero_point.reshape(-1).long(), zero_point.reshape(-1).long())


@pytest.mark.parametrize(("dtype", "qscheme", "spec"), SCHEMES)
@pytest.mark.parametrize("seed", [0, 1])
def test_minmax_matches_torch_ao(dtype, qscheme, spec, seed):
    peer = ao.MinMaxObserver(dtype=dtype, qscheme=qscheme)
    ours = make_observer("minmax", spec)
    for x in _batches(seed, (64, 33)):
        peer(x)
        ours.observe(x)
    _assert_same(ours.compute_params(), *peer.calculate_qparams())


@pytest.mark.parametrize(("dtype", "qscheme", "spec"), SCHEMES)
@pytest.mark.parametrize("momentum", [0.01, 0.3])
def test_ema_matches_torch_ao(dtype, qscheme, spec, momentum):
    peer = ao.MovingAverageMinMaxObserver(averaging_constant=momentum, dtype=dtype, qscheme=qscheme)
    ours = make_observer("ema", spec, momentum=momentum)
    for x in _batches(3, (1000,), count=20):
        peer(x)
        ours.observe(x)
    _assert_same(ours.compute_params(), *peer.calculate_qparams())
    assert torch.equal(ours.min_val, peer.min_val.reshape(1))


@pytest.mark.parametrize(("dtype", "qscheme", "spec"), SCHEMES)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_per_channel_minmax_matches_torch_ao(dtype, qscheme, spec, axis):
    peer = ao.PerChannelMinMaxObserver(ch_axis=axis % 3, dtype=dtype, qscheme=PER_CHANNEL[qscheme])
    ours = make_observer("minmax", spec.with_(granularity=Granularity.PER_CHANNEL, axis=axis))
    for x in _batches(5, (6, 7, 8)):
        peer(x)
        ours.observe(x)
    params = ours.compute_params()
    assert params.scale.shape == (x.shape[axis],)
    _assert_same(params, *peer.calculate_qparams())


@pytest.mark.parametrize(("dtype", "qscheme", "spec"), SCHEMES)
def test_per_channel_ema_matches_torch_ao(dtype, qscheme, spec):
    peer = ao.MovingAveragePerChannelMinMaxObserver(averaging_constant=0.1, ch_axis=1, dtype=dtype,
                                                    qscheme=PER_CHANNEL[qscheme])
    ours = make_observer("ema", spec.with_(granularity=Granularity.PER_CHANNEL, axis=1), momentum=0.1)
    for x in _batches(9, (4, 5, 16), count=8):
        peer(x)
        ours.observe(x)
    _assert_same(ours.compute_params(), *peer.calculate_qparams())


@pytest.mark.parametrize(("dtype", "qscheme", "spec"), SCHEMES)
def test_hist_l2_within_one_percent_of_torch_ao(dtype, qscheme, spec):
    torch.manual_seed(0)
    x = torch.randn(100000)
    peer = ao.HistogramObserver(bins=2048, dtype=dtype, qscheme=qscheme)
    peer(x)
    peer_scale, peer_zp = peer.calculate_qparams()
    ours = make_observer("hist_l2", spec)
    ours.observe(x)
    params = ours.compute_params()
    assert float(params.scale) == pytest.approx(float(peer_scale), rel=0.01)
    assert abs(int(params.zero_point) - int(peer_zp)) <= 1


def test_hist_l2_with_outliers_matches_torch_ao():
    g = torch.Generator().manual_seed(4)
    x = torch.rand(50000, generator=g)
    x[:3] = torch.tensor([40.0, -25.0, 30.0])
    peer = ao.HistogramObserver(bins=2048, dtype=torch.quint8, qscheme=torch.per_tensor_affine)
    peer(x)
    peer_scale, _ = peer.calculate_qparams()
    ours = make_observer("hist_l2", QuantSpec.uint8_affine())
    ours.observe(x)
    scale = float(ours.compute_params().scale)
    assert scale == pytest.approx(float(peer_scale), rel=0.01)
