"""The seven rounding policies of PPQ, exact for every float32 value.

Ties (x = k + 0.5) are where the policies differ:

    policy                      -2.5  -1.5  -0.5   0.5   1.5   2.5
    ROUND_HALF_EVEN               -2    -2    -0     0     2     2   (torch.round, IEEE default)
    ROUND_HALF_UP                 -2    -1     0     1     2     3   (toward +inf)
    ROUND_HALF_DOWN               -3    -2    -1     0     1     2   (toward -inf)
    ROUND_HALF_TOWARDS_ZERO       -2    -1    -0     0     1     2
    ROUND_HALF_FAR_FROM_ZERO      -3    -2    -1     1     2     3   (C round())
    ROUND_TO_NEAR_INT             -3    -2    -1     1     2     3   (PPQ: x>0 ? floor(x+.5) : ceil(x-.5))
    ROUND_UP                      -2    -1    -0     1     2     3   (ceil)

Non-ties round to the nearest integer for all policies except ROUND_UP (ceil).
ROUND_TO_NEAR_INT follows PPQ's definition (``ppq_numerical_round`` and its CUDA kernel, where it
falls back to C ``round``), so it equals ROUND_HALF_FAR_FROM_ZERO.

The implementations avoid ``floor(x + 0.5)``, which is wrong for 0.49999997 (the sum rounds up to
1.0) and for odd integers in [2^23, 2^24); they start from r = round_half_even(x) and correct the
ties using d = x - r, which is exact in floating point and equals +-1/2 exactly on ties.
"""

from __future__ import annotations

import torch

from netquant.core.spec import RoundingPolicy
from netquant.errors import ConfigError


def _round_half_up_(x: torch.Tensor) -> torch.Tensor:
    """r + max(floor(2d), 0) with r = round_half_even(x), d = x - r in [-1/2, 1/2] (exact)."""
    r = torch.round(x)
    d = x.sub_(r).mul_(2).floor_().clamp_min_(0).nan_to_num_(0.0)  # 1 where d == 1/2 (tie rounded down)
    return r.add_(d)


def _round_half_down_(x: torch.Tensor) -> torch.Tensor:
    """r + min(ceil(2d), 0): -1 where d == -1/2 (tie rounded up)."""
    r = torch.round(x)
    d = x.sub_(r).mul_(2).ceil_().clamp_max_(0).nan_to_num_(0.0)
    return r.add_(d)


def round_with_policy_(x: torch.Tensor, policy: RoundingPolicy,
                       sign_source: torch.Tensor | None = None) -> torch.Tensor:
    """Round a floating tensor to integers by `policy`, using `x` as scratch (pass a temporary).

    Returns the rounded tensor (`x` itself or a new one). Policies that treat ties by their sign
    (towards / far from zero) need the sign of the original values: `sign_source` (any tensor of the
    same shape and signs, e.g. the input that `x` was scaled from by a positive factor), else a copy
    is taken. Only same-dtype, in-place float ops are used (mixed bool/float ops are slow on CPU).
    NaN and +-Inf pass through unchanged.
    """
    if policy is RoundingPolicy.ROUND_HALF_EVEN:
        return x.round_()
    if policy is RoundingPolicy.ROUND_UP:
        return x.ceil_()
    if policy is RoundingPolicy.ROUND_HALF_UP:
        return _round_half_up_(x)
    if policy is RoundingPolicy.ROUND_HALF_DOWN:
        return _round_half_down_(x)
    if policy in (RoundingPolicy.ROUND_HALF_FAR_FROM_ZERO, RoundingPolicy.ROUND_TO_NEAR_INT,
                  RoundingPolicy.ROUND_HALF_TOWARDS_ZERO):
        sign = x.clone() if sign_source is None else sign_source
        x = x.abs_()
        r = _round_half_down_(x) if policy is RoundingPolicy.ROUND_HALF_TOWARDS_ZERO else _round_half_up_(x)
        return r.copysign_(sign)
    raise ConfigError(f"unknown rounding policy {policy!r}; use a netquant.RoundingPolicy member")


def round_with_policy(x: torch.Tensor, policy: RoundingPolicy) -> torch.Tensor:
    """Round `x` to integers (same dtype) with the given policy; `x` is not modified."""
    if not isinstance(policy, RoundingPolicy):
        raise ConfigError(f"rounding policy must be a netquant.RoundingPolicy, got {policy!r}")
    if not x.is_floating_point():
        return x.clone()
    return round_with_policy_(x.clone(), policy, sign_source=x)
