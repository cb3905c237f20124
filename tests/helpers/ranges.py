"""Hand reference of the calibration range rule (netquant.calib.ranges): ends rounded outward to 8 bits."""

from __future__ import annotations

import math


def round_out(v: float, bits: int = 8) -> float:
    """|v| = m * 2^e with m in [0.5, 1) -> sign(v) * ceil(m * 2^bits) * 2^(e - bits) (math.frexp, by hand)."""
    if v == 0:
        return 0.0
    m, e = math.frexp(abs(v))
    return math.copysign(math.ceil(m * 2 ** bits) * 2.0 ** (e - bits), v)


def amax_out(amax: float, bits: int = 8) -> float:
    """The calibrated activation amax of a symmetric min-max observer: max|x| rounded outward."""
    return round_out(float(amax), bits)
