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

The implementations avoid ``floor(x + 0.5)``, which is wrong for 0.49999997 (the sum rounds up to 1.0)
and for odd integers >= 2^23; the fractional part ``x - floor(x)`` is exact in floating point.
"""

from __future__ import annotations

import torch

from netquant.core.spec import RoundingPolicy
from netquant.errors import ConfigError


def _half_up_(x: torch.Tensor) -> torch.Tensor:
    """floor(x) + (frac(x) >= 0.5), in place."""
    f = torch.floor(x)
    x.sub_(f)  # exact fractional part in [0, 1)
    return f.add_(x.ge(0.5))


def _half_down_(x: torch.Tensor) -> torch.Tensor:
    """ceil(x) - (ceil(x) - x >= 0.5)  ==  floor(x) + (frac(x) > 0.5), in place."""
    f = torch.floor(x)
    x.sub_(f)
    return f.add_(x.gt(0.5))


def _half_abs_(x: torch.Tensor, away: bool) -> torch.Tensor:
    """sign(x) * (floor(|x|) + (frac(|x|) >= 0.5 if away else > 0.5))."""
    a = torch.abs(x)
    f = torch.floor(a)
    a.sub_(f)
    f.add_(a.ge(0.5) if away else a.gt(0.5))
    return f.copysign_(x)


def round_with_policy_(x: torch.Tensor, policy: RoundingPolicy) -> torch.Tensor:
    """Round a floating tensor to integers by `policy`; may reuse `x` as scratch (pass a temporary).

    Returns the rounded tensor (possibly `x` itself). NaN and +-Inf pass through unchanged.
    """
    if policy is RoundingPolicy.ROUND_HALF_EVEN:
        return x.round_()
    if policy is RoundingPolicy.ROUND_UP:
        return x.ceil_()
    if policy is RoundingPolicy.ROUND_HALF_UP:
        out = _half_up_(x)
    elif policy is RoundingPolicy.ROUND_HALF_DOWN:
        out = _half_down_(x)
    elif policy is RoundingPolicy.ROUND_HALF_TOWARDS_ZERO:
        out = _half_abs_(x, away=False)
    elif policy in (RoundingPolicy.ROUND_HALF_FAR_FROM_ZERO, RoundingPolicy.ROUND_TO_NEAR_INT):
        out = _half_abs_(x, away=True)
    else:  # pragma: no cover - enum is closed
        raise ConfigError(f"unknown rounding policy {policy!r}; use a netquant.RoundingPolicy member")
    return out


def round_with_policy(x: torch.Tensor, policy: RoundingPolicy) -> torch.Tensor:
    """Round `x` to integers (same dtype) with the given policy; `x` is not modified."""
    if not isinstance(policy, RoundingPolicy):
        raise ConfigError(f"rounding policy must be a netquant.RoundingPolicy, got {policy!r}")
    if not x.is_floating_point():
        return x.clone()
    return round_with_policy_(x.clone(), policy)
