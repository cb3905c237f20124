"""a.merge(b) == one observer that saw a's stream then b's, on random splits, for every observer.

Exact for min-max, fixed, and every histogram observer on the POW2 grid (its histogram depends
only on the values seen).  EMA is exact up to float rounding (the merge continues a's average
through b's batches in closed form).  On the TensorRT grid the first batch fixes the bin width,
so two halves usually have different widths; their merge spreads one histogram over the
other's bins: counts are conserved and the cumulative distribution moves by at most one source
bin, but the argmin-type thresholds (KL, L2) can jump between near-equal minima, so for that
grid we assert exactness (up to TensorRT's top-bin clamp) only when the widths agree and bound
the histogram otherwise.  Use grid="pow2" to split calibration across processes.
"""

from __future__ import annotations

import pytest
import torch

from netquant.calib import OBSERVERS, GridMode, make_observer
from netquant.core.spec import Granularity, QuantSpec

HIST = ["kl", "percentile", "mse", "hist_l2"]


def _stream(seed: int, per_channel: bool = False) -> tuple[list[torch.Tensor], int]:
    g = torch.Generator().manual_seed(seed)
    count = int(torch.randint(2, 7, (1,), generator=g))
    shape = (4, 3000) if per_channel else (int(torch.randint(500, 6000, (1,), generator=g)),)
    batches = []
    for _ in range(count):
        scale = float(torch.rand(1, generator=g)) * 3 + 0.1
        shift = float(torch.randn(1, generator=g)) * 0.3
        batches.append(torch.randn(shape, generator=g) * scale + shift)
    cut = int(torch.randint(1, count, (1,), generator=g))
    return batches, cut


def _opts(name: str, grid: GridMode) -> dict[str, object]:
    if name in HIST:
        return {"grid": grid, "num_bins": 512}
    if name == "fixed":
        return {"min_val": -1.0, "max_val": 2.0}
    return {}


def _run(name, spec, batches, cut, grid, splits=None):
    full = make_observer(name, spec, **_opts(name, grid))
    parts = [make_observer(name, spec, **_opts(name, grid)) for _ in range(2)]
    for i, x in enumerate(batches):
        full.observe(x)
        parts[0 if i < cut else 1].observe(x)
    merged = parts[0].merge(parts[1])
    return full, merged


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("name", sorted(set(OBSERVERS) - {"none"}))
@pytest.mark.parametrize("spec", [QuantSpec.int8(), QuantSpec.uint8_affine()], ids=["int8", "uint8_affine"])
def test_merge_equals_single_stream(name, seed, spec):
    batches, cut = _stream(seed)
    full, merged = _run(name, spec, batches, cut, GridMode.POW2)
    assert merged.num_batches == full.num_batches and merged.num_values == full.num_values
    a, b = full.compute_params(), merged.compute_params()
    if name == "ema":
        torch.testing.assert_close(merged.range(), full.range(), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(b.scale, a.scale, rtol=1e-6, atol=0)
        assert abs(int(b.zero_point) - int(a.zero_point)) <= 1
    else:
        assert torch.equal(merged.range()[0], full.range()[0]) and torch.equal(merged.range()[1], full.range()[1])
        assert torch.equal(a.scale, b.scale) and torch.equal(a.zero_point, b.zero_point)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", ["minmax", "ema", *HIST])
def test_per_channel_merge_equals_single_stream(name, seed):
    batches, cut = _stream(seed, per_channel=True)
    spec = QuantSpec.int8(granularity=Granularity.PER_CHANNEL, axis=0)
    full, merged = _run(name, spec, batches, cut, GridMode.POW2)
    torch.testing.assert_close(merged.range(), full.range(), rtol=1e-6, atol=1e-6)
    assert merged.compute_params().scale.shape == (4,)


@pytest.mark.parametrize("name", HIST)
def test_pow2_histogram_is_order_independent(name):
    batches, _ = _stream(11)
    forward = make_observer(name, QuantSpec.int8(), grid="pow2")
    backward = make_observer(name, QuantSpec.int8(), grid="pow2")
    for x in batches:
        forward.observe(x)
    for x in reversed(batches):
        backward.observe(x)
    assert torch.equal(forward.hist.counts, backward.hist.counts)
    assert torch.equal(forward.amax(), backward.amax())


def test_merge_many_workers_in_any_order():
    """Calibration split over 4 'processes', merged in scrambled order, equals one pass."""
    batches, _ = _stream(5)
    batches = batches * 2
    full = make_observer("kl", QuantSpec.int8(), grid="pow2")
    workers = [make_observer("kl", QuantSpec.int8(), grid="pow2") for _ in range(4)]
    for i, x in enumerate(batches):
        full.observe(x)
        workers[i % 4].observe(x)
    root = workers[2].merge(workers[0]).merge(workers[3]).merge(workers[1])
    assert torch.equal(root.hist.counts, full.hist.counts)
    assert torch.equal(root.compute_params().scale, full.compute_params().scale)


@pytest.mark.parametrize("name", HIST)
def test_tensorrt_grid_merge_exact_when_widths_agree(name):
    g = torch.Generator().manual_seed(2)
    first = torch.randn(4000, generator=g)
    first[:2] = torch.tensor([5.0, -5.0])  # both halves start with the same range: same bin width
    second = torch.randn(4000, generator=g)
    second[:2] = torch.tensor([-5.0, 5.0])
    tail = torch.randn(3000, generator=g) * 2
    full = make_observer(name, QuantSpec.int8())
    a, b = make_observer(name, QuantSpec.int8()), make_observer(name, QuantSpec.int8())
    for x in (first, tail):
        full.observe(x)
    full.observe(second)
    a.observe(first)
    a.observe(tail)
    b.observe(second)
    assert torch.equal(a.hist.width, b.hist.width)
    a.merge(b)
    # TensorRT puts a batch's maximum into the last bin of its own grid (b's 5.0 sits on b's top
    # edge, so b counted it in bin 2047); the single stream had already grown past 5.0 and counted
    # it in bin 2048.  Those values are the only difference (none for the signed histogram).
    diff = (a.hist.counts - full.hist.counts).abs()
    assert float(diff.sum()) <= 4.0 and float(a.hist.counts.sum()) == float(full.hist.counts.sum())
    assert torch.equal(a.compute_params().scale, full.compute_params().scale)


@pytest.mark.parametrize("seed", range(5))
def test_tensorrt_grid_merge_conserves_counts(seed):
    batches, cut = _stream(seed)
    full, merged = _run("percentile", QuantSpec.int8(), batches, cut, GridMode.TENSORRT)
    cf, ef = full.hist.channel(0)
    cm, em = merged.hist.channel(0)
    assert float(cm.sum()) == pytest.approx(float(cf.sum()), rel=1e-12)
    # both CDFs evaluated at the merged grid's edges differ by at most the largest bin's count
    # of the split-off stream (one source bin can land on either side of an edge)
    cdf_full = torch.cat([torch.zeros(1, dtype=torch.float64), cf.cumsum(0)])
    cdf_merged = torch.cat([torch.zeros(1, dtype=torch.float64), cm.cumsum(0)])
    at = torch.searchsorted(ef, em, right=True).clamp(max=cf.numel())
    bound = max(float(cf.max()), float(cm.max())) * 2
    assert float((cdf_full[at] - cdf_merged).abs().max()) <= bound
    # the percentile threshold moves by at most a couple of bins
    width = float(full.hist.width[0])
    assert abs(float(full.amax()) - float(merged.amax())) <= 3 * width


def test_merge_rejects_mismatches():
    from netquant.errors import ConfigError, DataError

    a = make_observer("kl", QuantSpec.int8())
    with pytest.raises(ConfigError, match="merge a minmax observer into a kl"):
        a.merge(make_observer("minmax", QuantSpec.int8()))
    with pytest.raises(ConfigError, match="different specs"):
        a.merge(make_observer("kl", QuantSpec.uint8_affine()))
    with pytest.raises(ConfigError, match="different options"):
        a.merge(make_observer("kl", QuantSpec.int8(), num_bins=1024))
    pc = QuantSpec.int8(granularity=Granularity.PER_CHANNEL, axis=0)
    x, y = make_observer("minmax", pc), make_observer("minmax", pc)
    x.observe(torch.randn(3, 5))
    y.observe(torch.randn(4, 5))
    with pytest.raises(DataError, match="channel layouts differ"):
        x.merge(y)


def test_merge_into_empty_and_of_empty():
    x = torch.randn(1000)
    for name in ["minmax", "ema", *HIST]:
        empty, seen = make_observer(name, QuantSpec.int8()), make_observer(name, QuantSpec.int8())
        seen.observe(x)
        ref = seen.compute_params()
        assert torch.equal(empty.merge(seen).compute_params().scale, ref.scale)
        assert torch.equal(seen.merge(make_observer(name, QuantSpec.int8())).compute_params().scale, ref.scale)


@pytest.mark.parametrize("name", sorted(set(OBSERVERS) - {"none"}))
def test_observers_pickle_for_merging_across_processes(name):
    import pickle

    batches, cut = _stream(8)
    full, _ = _run(name, QuantSpec.int8(), batches, cut, GridMode.POW2)
    worker = make_observer(name, QuantSpec.int8(), **_opts(name, GridMode.POW2))
    root = make_observer(name, QuantSpec.int8(), **_opts(name, GridMode.POW2))
    for i, x in enumerate(batches):
        (root if i < cut else worker).observe(x)
    blob = pickle.dumps(worker)
    assert len(blob) < 200_000  # state only: histograms, not data or scratch buffers
    root.merge(pickle.loads(blob))
    torch.testing.assert_close(root.range(), full.range(), rtol=1e-6, atol=1e-6)
