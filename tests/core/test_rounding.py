"""The seven rounding policies: hand-checked ties, exact reference on random floats, edge values."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from netquant.core.rounding import round_with_policy
from netquant.core.spec import RoundingPolicy as R
from netquant.errors import ConfigError

TIES = [-2.5, -1.5, -0.5, 0.5, 1.5, 2.5]

# Hand-checked: each row read off the policy's definition for x = -2.5, -1.5, -0.5, 0.5, 1.5, 2.5.
TIE_TABLE = {
    R.ROUND_HALF_EVEN: [-2, -2, 0, 0, 2, 2],
    R.ROUND_HALF_UP: [-2, -1, 0, 1, 2, 3],
    R.ROUND_HALF_DOWN: [-3, -2, -1, 0, 1, 2],
    R.ROUND_HALF_TOWARDS_ZERO: [-2, -1, 0, 0, 1, 2],
    R.ROUND_HALF_FAR_FROM_ZERO: [-3, -2, -1, 1, 2, 3],
    R.ROUND_TO_NEAR_INT: [-3, -2, -1, 1, 2, 3],  # PPQ: x > 0 ? floor(x + .5) : ceil(x - .5)
    R.ROUND_UP: [-2, -1, 0, 1, 2, 3],  # ceil
}

NON_TIES = [-2.7, -2.2, -0.7, -0.2, 0.2, 0.7, 1.2, 2.7]


@pytest.mark.parametrize("policy", list(R))
def test_ties_match_hand_checked_table(policy: R) -> None:
    got = round_with_policy(torch.tensor(TIES), policy)
    assert got.tolist() == [float(v) for v in TIE_TABLE[policy]]


@pytest.mark.parametrize("policy", [p for p in R if p is not R.ROUND_UP])
def test_non_ties_round_to_nearest(policy: R) -> None:
    got = round_with_policy(torch.tensor(NON_TIES), policy)
    assert got.tolist() == [-3.0, -2.0, -1.0, -0.0, 0.0, 1.0, 1.0, 3.0]


def test_round_up_is_ceil_on_non_ties() -> None:
    got = round_with_policy(torch.tensor(NON_TIES), R.ROUND_UP)
    assert got.tolist() == [-2.0, -2.0, -0.0, -0.0, 1.0, 1.0, 2.0, 3.0]


def _reference(v: float, policy: R) -> float:
    """Exact rational rounding of the float32 value v."""
    f = Fraction(v)
    lo = math.floor(f)
    frac = f - lo
    if policy is R.ROUND_UP:
        return float(math.ceil(f))
    if frac != Fraction(1, 2):
        return float(lo + (1 if frac > Fraction(1, 2) else 0))
    hi = lo + 1
    if policy is R.ROUND_HALF_EVEN:
        return float(lo if lo % 2 == 0 else hi)
    if policy is R.ROUND_HALF_UP:
        return float(hi)
    if policy is R.ROUND_HALF_DOWN:
        return float(lo)
    if policy is R.ROUND_HALF_TOWARDS_ZERO:
        return float(lo if f > 0 else hi)
    return float(hi if f > 0 else lo)  # far from zero / near int


f32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-1e9, max_value=1e9)
halves = st.integers(-2**24, 2**24).map(lambda k: k / 2.0)  # many exact ties


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.one_of(f32, halves), min_size=1, max_size=64), policy=st.sampled_from(list(R)))
def test_matches_exact_reference(values: list[float], policy: R) -> None:
    x = torch.tensor(values, dtype=torch.float32)
    got = round_with_policy(x, policy)
    want = [_reference(v, policy) for v in x.tolist()]
    assert [g == w for g, w in zip(got.tolist(), want)] == [True] * len(want)


@pytest.mark.parametrize("policy", list(R))
def test_values_where_floor_x_plus_half_is_wrong(policy: R) -> None:
    # 0.49999997 + 0.5 rounds to 1.0 in float32, and 1.4999999 + 0.5 rounds to 2.0; 2^23 + 1 is odd.
    x = torch.tensor([0.49999997, -0.49999997, 1.4999999, 8388609.0, -8388609.0], dtype=torch.float32)
    want = [_reference(v, policy) for v in x.tolist()]
    assert round_with_policy(x, policy).tolist() == want


@pytest.mark.parametrize("policy", list(R))
def test_non_finite_pass_through(policy: R) -> None:
    x = torch.tensor([float("inf"), -float("inf"), float("nan")])
    got = round_with_policy(x, policy)
    assert got[0] == float("inf") and got[1] == -float("inf") and torch.isnan(got[2])


def test_input_not_modified_and_dtype_kept() -> None:
    x = torch.tensor([0.5, 1.5], dtype=torch.float64)
    got = round_with_policy(x, R.ROUND_HALF_UP)
    assert x.tolist() == [0.5, 1.5] and got.dtype == torch.float64 and got.tolist() == [1.0, 2.0]


def test_bad_policy_raises_config_error() -> None:
    with pytest.raises(ConfigError, match="RoundingPolicy"):
        round_with_policy(torch.zeros(2), "half_up")  # type: ignore[arg-type]
