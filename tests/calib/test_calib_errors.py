"""Bad and degenerate data: NaN / Inf, empty batches, no data, constant tensors, bad configs."""

from __future__ import annotations

import pytest
import torch

from netquant.calib import OBSERVERS, make_observer
from netquant.core.ops import fake_quantize
from netquant.core.spec import Granularity, QuantSpec, ScaleConstraint
from netquant.errors import CalibrationError, ConfigError, DataError

DATA_OBSERVERS = sorted(set(OBSERVERS) - {"none", "fixed"})


def _x(seed: int = 0, n: int = 4000) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", DATA_OBSERVERS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_raises_naming_tensor(name, bad):
    obs = make_observer(name, QuantSpec.int8(), tensor_name="conv3.out")
    obs.observe(_x())
    x = _x(1)
    x[17] = bad
    with pytest.raises(DataError, match=r"tensor 'conv3.out': batch 1 has (1 NaN|0 NaN and 1 Inf)"):
        obs.observe(x)


@pytest.mark.parametrize("name", DATA_OBSERVERS)
@pytest.mark.parametrize("per_channel", [False, True])
def test_ignore_nonfinite_counts_and_skips(name, per_channel):
    spec = QuantSpec.int8(granularity=Granularity.PER_CHANNEL, axis=1) if per_channel else QuantSpec.int8()
    clean = _x(2).reshape(1000, 4)
    dirty = clean.clone()
    dirty[3, 1], dirty[7, 2], dirty[0, 3] = float("nan"), float("inf"), float("-inf")
    kept = torch.isfinite(dirty)
    # the reference sees only the finite values (replaced by a copy of another finite value of the
    # same channel; min/max and all histograms are unchanged if that value is counted separately)
    ours = make_observer(name, spec, ignore_nonfinite=True)
    ours.observe(dirty)
    assert ours.nonfinite_count == 3
    assert "3 non-finite values ignored" in ours.summary()
    ref = make_observer(name, spec)
    if per_channel:
        for c in range(4):
            col = dirty[:, c][kept[:, c]]
            ref_c = make_observer(name, QuantSpec.int8())
            ref_c.observe(col)
            assert float(ours.amax()[c]) == pytest.approx(float(ref_c.amax()), rel=1e-6)
    else:
        ref.observe(dirty[kept])
        assert torch.equal(ours.compute_params().scale, ref.compute_params().scale)
        assert ours.num_values == ref.num_values == 4000 - 3


@pytest.mark.parametrize("name", DATA_OBSERVERS)
def test_no_data_raises(name):
    obs = make_observer(name, QuantSpec.int8(), tensor_name="head")
    with pytest.raises(CalibrationError, match="'head' has no data"):
        obs.compute_params()
    obs.observe(torch.empty(0, 3))
    with pytest.raises(CalibrationError, match="1 empty batches"):
        obs.compute_params()
    bad = make_observer(name, QuantSpec.int8(), ignore_nonfinite=True)
    bad.observe(torch.full((10,), float("nan")))
    with pytest.raises(CalibrationError, match="10 non-finite values ignored"):
        bad.compute_params()


@pytest.mark.parametrize("name", DATA_OBSERVERS)
def test_empty_batches_are_skipped(name):
    obs, ref = make_observer(name, QuantSpec.int8()), make_observer(name, QuantSpec.int8())
    obs.observe(torch.empty(0))
    obs.observe(_x())
    obs.observe(torch.empty(5, 0))
    ref.observe(_x())
    assert obs.empty_batches == 2
    assert torch.equal(obs.compute_params().scale, ref.compute_params().scale)


SPECS = [
    QuantSpec.int8(), QuantSpec.uint8_affine(), QuantSpec(bits=8, signed=False, symmetric=True),
    QuantSpec.int8(scale_constraint=ScaleConstraint.POWER_OF_TWO), QuantSpec(bits=4), QuantSpec.fp8_e4m3(),
]


@pytest.mark.parametrize("name", DATA_OBSERVERS)
@pytest.mark.parametrize("value", [0.0, 3.5, -2.0, 1e-30])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.describe())
def test_constant_tensor_gives_finite_nonzero_scale(name, value, spec):
    obs = make_observer(name, spec)
    obs.observe(torch.full((64, 8), value))
    obs.observe(torch.full((100,), value))
    params = obs.compute_params()
    assert torch.isfinite(params.scale).all() and (params.scale > 0).all()
    # the constant comes back through deployment's fake-quantizer to within rounding
    v = torch.tensor(value)
    back = fake_quantize(v, params.scale, params.zero_point, spec)
    scale = float(params.scale)
    tol = abs(value) / 16 + scale * 2**-9 if spec.is_float else scale / 2 + abs(value) / 1024
    assert abs(float(back) - value) <= tol



@pytest.mark.parametrize("name", ["kl", "percentile", "mse", "hist_l2"])
def test_zeros_before_data_are_counted(name):
    obs, ref = make_observer(name, QuantSpec.int8(), grid="pow2"), make_observer(name, QuantSpec.int8(), grid="pow2")
    zeros = torch.zeros(500)
    x = _x(4)
    obs.observe(zeros)
    obs.observe(x)
    ref.observe(torch.cat([x, zeros]))
    assert float(obs.hist.total()[0]) == 4500
    assert torch.equal(obs.hist.counts, ref.hist.counts)


def test_registry_errors():
    with pytest.raises(ConfigError, match=r"unknown observer 'minmix'; valid names: ema, fixed, hist_l2, kl, minmax"):
        make_observer("minmix")
    with pytest.raises(ConfigError, match=r"does not take option\(s\) \['momentum'\]"):
        make_observer("kl", QuantSpec.int8(), momentum=0.1)
    assert make_observer("entropy").name == "kl"
    with pytest.raises(ConfigError, match="percentile must be in"):
        make_observer("percentile", percentile=101)
    with pytest.raises(ConfigError, match="momentum"):
        make_observer("ema", momentum=0.0)
    with pytest.raises(ConfigError, match="grid must be one of"):
        make_observer("kl", grid="log")
    with pytest.raises(ConfigError, match="min_val <= max_val"):
        make_observer("fixed", min_val=1.0, max_val=0.0)
    with pytest.raises(ConfigError, match="spec must be a QuantSpec"):
        make_observer("minmax", "int8")  # type: ignore[arg-type]


def test_passive_observer_refuses_params():
    obs = make_observer("none", QuantSpec.int8(), tensor_name="reshape_out")
    obs.observe(torch.randn(3))
    with pytest.raises(ConfigError, match="'reshape_out' has no observer"):
        obs.compute_params()


def test_layout_errors():
    pc = QuantSpec.int8(granularity=Granularity.PER_CHANNEL, axis=2)
    obs = make_observer("minmax", pc, tensor_name="w")
    with pytest.raises(DataError, match="axis 2 is out of range for a 2-d tensor"):
        obs.observe(torch.randn(3, 4))
    obs.observe(torch.randn(2, 3, 4))
    with pytest.raises(DataError, match="same channel count"):
        obs.observe(torch.randn(2, 3, 5))
    with pytest.raises(DataError, match="expected a torch.Tensor"):
        obs.observe([1.0, 2.0])  # type: ignore[arg-type]
    grouped = make_observer("minmax", QuantSpec.int4_per_group(group_size=4, axis=1))
    with pytest.raises(DataError, match="not a multiple of group_size 4"):
        grouped.observe(torch.randn(2, 6))


def test_channel_without_finite_values():
    obs = make_observer("minmax", QuantSpec.int8(granularity=Granularity.PER_CHANNEL, axis=0),
                        ignore_nonfinite=True, tensor_name="t")
    x = torch.randn(3, 5)
    x[1] = float("nan")
    obs.observe(x)
    with pytest.raises(CalibrationError, match="channel 1 .* saw no finite value"):
        obs.compute_params()
