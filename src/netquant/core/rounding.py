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

The implementations avoid ``floor(x + 0.5)``, which is wrong for 0.49999997 and 1.4999999 (the sum
rounds up to the next integer) and for odd integers >= 2^23; they decide on the fractional part
``x - trunc(x)``, which is exact in floating point (``x - floor(x)`` is not for small negative x).
"""

from __future__ import annotations

import torch

from netquant.core.spec import RoundingPolicy
from netquant.errors import ConfigError

# For each policy, the fractional part d = x - trunc(x) (exact in floating point, sign of x) decides:
# round away from zero when d >= hi_pos (x > 0) or d <= lo_neg (x < 0); `True` bounds include the tie.
_TIE_AWAY = {  # (tie goes up for positive x, tie goes down for negative x)
    RoundingPolicy.ROUND_HALF_UP: (True, False),
    RoundingPolicy.ROUND_HALF_DOWN: (False, True),
    RoundingPolicy.ROUND_HALF_TOWARDS_ZERO: (False, False),
    RoundingPolicy.ROUND_HALF_FAR_FROM_ZERO: (True, True),
    RoundingPolicy.ROUND_TO_NEAR_INT: (True, True),
}


def _round_ties_(x: torch.Tensor, pos_tie_up: bool, neg_tie_down: bool) -> torch.Tensor:
    """trunc(x) + [d > .5 or (d == .5 and pos_tie_up)] - [d < -.5 or (d == -.5 and neg_tie_down)]."""
    t = torch.trunc(x)
    d = x.sub_(t)  # exact fractional part (NaN for +-Inf, which then compares False)
    t.add_(d.ge(0.5) if pos_tie_up else d.gt(0.5))
    t.add_(d.le(-0.5) if neg_tie_down else d.lt(-0.5), alpha=-1)
    return t


def round_with_policy_(x: torch.Tensor, policy: RoundingPolicy) -> torch.Tensor:
    """Round a floating tensor to integers by `policy`; may reuse `x` as scratch (pass a temporary).

    Returns the rounded tensor (possibly `x` itself). NaN and +-Inf pass through unchanged.
    """
    if policy is RoundingPolicy.ROUND_HALF_EVEN:
        return x.round_()
    if policy is RoundingPolicy.ROUND_UP:
        return x.ceil_()
    ties = _TIE_AWAY.get(policy)
    if ties is None:  # pragma: no cover - enum is closed
        raise ConfigError(f"unknown rounding policy {policy!r}; use a netquant.RoundingPolicy member")
    return _round_ties_(x, *ties)


def round_with_policy(x: torch.Tensor, policy: RoundingPolicy) -> torch.Tensor:
    """Round `x` to integers (same dtype) with the given policy; `x` is not modified."""
    if not isinstance(policy, RoundingPolicy):
        raise ConfigError(f"rounding policy must be a netquant.RoundingPolicy, got {policy!r}")
    if not x.is_floating_point():
        return x.clone()
    return round_with_policy_(x.clone(), policy)
