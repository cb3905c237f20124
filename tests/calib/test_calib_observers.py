"""Per-channel / per-group layouts, spec handling, the histogram's growth and memory bound."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from netquant.calib import GridMode, Histogram, make_observer
from netquant.core.qparams import choose_qparams
from netquant.core.spec import Granularity, QuantSpec, ScaleConstraint
from tests.calib import trt_reference as ref


def _data(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.linspace(0.5, 3.0, shape[1]).view(1, -1, *[1] * (len(shape) - 2))


@pytest.mark.parametrize("name", ["kl", "percentile", "mse", "hist_l2", "minmax", "ema"])
@pytest.mark.parametrize("axis", [1, -2])
def test_per_channel_equals_per_tensor_on_each_slice(name, axis):
    """Batched per-channel histograms give each channel what a per-tensor observer of it gives."""
    batches = [_data(s, (16, 5, 300)) for s in range(3)]
    opts = {"num_bins": 512} if name in ("kl", "percentile", "mse", "hist_l2") else {}
    spec = QuantSpec.int8(granularity=Granularity.PER_CHANNEL, axis=axis)
    ours = make_observer(name, spec, **opts)
    for x in batches:
        ours.observe(x)
    lo, hi = ours.range()
    assert lo.shape == (5,)
    for c in range(5):
        single = make_observer(name, QuantSpec.int8(), **opts)
        for x in batches:
            single.observe(x.select(1, c))
        slo, shi = single.range()
        assert float(lo[c]) == pytest.approx(float(slo), rel=1e-6)
        assert float(hi[c]) == pytest.approx(float(shi), rel=1e-6)


def test_per_group_minmax_matches_manual_reduction():
    w = torch.randn(6, 32, generator=torch.Generator().manual_seed(1))
    spec = QuantSpec.int4_per_group(group_size=8, axis=1)
    obs = make_observer("minmax", spec)
    obs.observe(w)
    lo, hi = obs.range()
    groups = w.reshape(6, 4, 8)
    assert torch.equal(lo, groups.amin(-1)) and torch.equal(hi, groups.amax(-1))
    params = obs.compute_params()
    assert params.scale.shape == (6, 4)
    assert torch.equal(params.scale, choose_qparams(groups.amin(-1), groups.amax(-1), spec).scale)


@pytest.mark.parametrize("name", ["minmax", "kl", "percentile", "mse", "hist_l2"])
def test_power_of_two_spec_gives_power_of_two_scale(name):
    spec = QuantSpec.int8(scale_constraint=ScaleConstraint.POWER_OF_TWO)
    obs = make_observer(name, spec)
    obs.observe(_data(2, (64, 4)))
    scale = float(obs.compute_params().scale)
    assert scale == 2.0 ** round(math.log2(scale))
    free = choose_qparams(*obs.range(), QuantSpec.int8())
    assert float(free.scale) <= scale < 2 * float(free.scale)


def test_fixed_range_observer():
    obs = make_observer("fixed", QuantSpec.uint8_affine(), min_val=0.0, max_val=1.0, tensor_name="sigmoid")
    params = obs.compute_params()  # needs no data
    assert float(params.scale) == pytest.approx(1 / 255) and int(params.zero_point) == 0
    obs.observe(torch.tensor([5.0, float("nan")]))  # ignored: the range is known
    assert torch.equal(obs.compute_params().scale, params.scale)
    pc = make_observer("fixed", QuantSpec.int8_per_channel(axis=0), min_val=[-1.0, -2.0], max_val=[1.0, 2.0])
    assert pc.compute_params().scale.shape == (2,)


def test_call_passes_tensor_through():
    obs = make_observer("kl", QuantSpec.int8())
    x = torch.randn(100)
    assert obs(x) is x and obs.num_values == 100


def test_tensorrt_growth_matches_reference_collector():
    """Later batches with a larger max append bins of the first batch's width (TensorRT)."""
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(5000, generator=g) * s for s in (1.0, 1.5, 0.7, 2.0)]
    counts_np, edges_np = ref.collect(batches, num_bins=256)
    obs = make_observer("kl", QuantSpec.int8(), num_bins=256)
    for x in batches:
        obs.observe(x)
    counts, edges = obs.hist.channel(0)
    assert counts.numel() == len(counts_np) > 256
    np.testing.assert_allclose(edges.numpy(), edges_np, rtol=0, atol=1e-5)
    # the reference re-bins later batches with histc over [0, edges[-1]] whose float rounding puts a
    # handful of values that sit on an edge one bin over; we bin with floor(x / w) throughout
    assert float(np.abs(counts.numpy() - counts_np).sum()) <= 8
    assert float(obs.amax()) == ref.amax_entropy(counts_np, edges_np)


@pytest.mark.parametrize("grid", list(GridMode))
def test_histogram_memory_is_bounded(grid):
    """A range that explodes after the first batch does not grow the histogram without bound."""
    hist = Histogram(2048, grid=grid)
    for scale in (1e-3, 1.0, 1e3, 1e6):
        x = torch.randn(1, 10000) * scale
        lo, hi = torch.aminmax(x, dim=1)
        hist.add(x, None, lo, hi)
        assert hist.counts.shape[1] <= hist.max_bins
        assert float(hist.total()[0]) == pytest.approx(10000 * (1 + [1e-3, 1.0, 1e3, 1e6].index(scale)))
    counts, edges = hist.channel(0)
    assert float(edges[-1]) >= float(hist.vmax[0])


def test_pow2_histogram_bins_are_exact():
    """On the POW2 grid a value v lands in bin floor(v / w) exactly, w a power of two."""
    hist = Histogram(64, grid=GridMode.POW2)
    x = torch.tensor([[0.0, 0.25, 0.5, 0.75, 1.0, 1.0 - 2**-20, 3.0]])
    lo, hi = torch.aminmax(x, dim=1)
    hist.add(x, None, lo, hi)
    w = float(hist.width[0])
    assert w == 2.0 ** -4  # smallest power of two with 3 / w <= 64
    counts, _ = hist.channel(0)
    expected = torch.zeros_like(counts)
    for v in x.flatten().tolist():
        expected[int(v // w)] += 1
    assert torch.equal(counts, expected)


def test_signed_histogram_for_hist_l2_spans_negative_values():
    obs = make_observer("hist_l2", QuantSpec.uint8_affine())
    x = torch.rand(10000, generator=torch.Generator().manual_seed(0)) * 4 - 3  # [-3, 1)
    obs.observe(x)
    _, edges = obs.hist.channel(0)
    assert float(edges[0]) <= float(x.min()) and float(edges[-1]) > float(x.max())
    lo, hi = obs.range()
    assert -3.0 <= float(lo) < -2.9 and 0.9 < float(hi) <= 1.0
