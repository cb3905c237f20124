"""calib.ranges: the range rules both calibration flows (nn.calibrate, passes.calibration) apply."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from netquant.calib import make_observer
from netquant.calib.ranges import (
    activation_params,
    check_range_bits,
    clamp_for_observation,
    round_range_outward,
)
from netquant.core.spec import QuantSpec
from netquant.errors import ConfigError, DataError
from tests.helpers.ranges import round_out


def test_round_range_outward_hand_checked():
    # 3.14159 = 0.785 * 2^2 -> ceil(0.785 * 256) / 256 * 4 = 202 / 64 = 3.15625; -0.2785 = -0.557 * 2^-1 ->
    # -ceil(0.557 * 256) / 512 = -143 / 512; exact powers of two, zeros and 8-bit mantissas stay put
    lo, hi = round_range_outward(torch.tensor([-0.2785, 0.0, -1.0, -0.75]), torch.tensor([3.14159, 0.0, 1.0, 6.0]))
    assert lo.tolist() == [-143 / 512, 0.0, -1.0, -0.75]
    assert hi.tolist() == [202 / 64, 0.0, 1.0, 6.0]
    lo4, hi4 = round_range_outward(torch.tensor([-0.3]), torch.tensor([0.3]), bits=4)
    assert lo4.tolist() == [-10 / 32] and hi4.tolist() == [10 / 32]  # 0.3 = 0.6 * 2^-1 -> ceil(9.6) / 16 / 2


def test_rounded_range_never_shrinks_and_stays_within_one_part_in_2_to_the_bits():
    v = torch.from_numpy(np.random.default_rng(0).standard_normal(10_000).astype(np.float32)) * 100
    lo, hi = round_range_outward(-v.abs(), v.abs())
    assert bool((hi >= v.abs()).all()) and bool((lo <= -v.abs()).all())
    assert float(((hi - v.abs()) / v.abs()).max()) <= 2.0 ** -7


def test_hand_reference_helper_agrees():
    v = torch.from_numpy(np.random.default_rng(2).standard_normal(200).astype(np.float32)) * 7
    lo, hi = round_range_outward(-v.abs(), v.abs())
    assert hi.tolist() == [round_out(float(a)) for a in v.abs()]
    assert lo.tolist() == [round_out(-float(a)) for a in v.abs()]


def test_activation_params_round_the_range_then_choose():
    obs = make_observer("minmax", QuantSpec.int8(narrow_range=True), tensor_name="t")
    obs.observe(torch.tensor([-0.5, 3.14159]))
    p = activation_params(obs)
    assert float(p.scale) == pytest.approx((202 / 64) / 127, rel=1e-7)  # 3.14159 -> 3.15625, s = amax / 127
    assert float(activation_params(obs, None).scale) == pytest.approx(3.14159 / 127, rel=1e-7)


def test_zero_range_gives_eps_and_nonfinite_is_a_data_error():
    obs = make_observer("minmax", QuantSpec.int8(), tensor_name="zeros")
    obs.observe(torch.zeros(8))
    assert float(activation_params(obs).scale) == torch.finfo(torch.float32).eps
    bad = make_observer("minmax", QuantSpec.int8(), tensor_name="bad")
    with pytest.raises(DataError, match="'bad'.*NaN"):
        bad.observe(torch.tensor([1.0, float("nan")]))


def test_clamp_for_observation_margin():
    x = torch.tensor([-10.0, -3.0, 0.0, 2.0])
    expected = torch.tensor([-3.06, -3.0, 0.0, 2.0])  # 2 % below the bound (float32)
    assert torch.equal(clamp_for_observation(x, -3.0), expected)
    assert torch.equal(clamp_for_observation(x, 0.0), torch.tensor([-1e-3, -1e-3, 0.0, 2.0]))  # at least 1e-3


@pytest.mark.parametrize("bad", [0, 1, 53, 2.5, "8", True])
def test_check_range_bits(bad):
    assert check_range_bits(None, "x") is None and check_range_bits(8, "x") == 8
    with pytest.raises(ConfigError, match="range_bits"):
        check_range_bits(bad, "x")
