"""The range rules of calibration, one home for both flows.

`netquant.nn.calibrate` (module API) and `netquant.passes.calibration` (graph PTQ) build their
observers with `netquant.calib.make_observer` and turn them into params here, so the same data and
observer give the same scales in both:

- activations: the observer's range (lo, hi) rounded outward to `range_bits` significant bits
  (`round_range_outward`, default `RANGE_MANTISSA_BITS` = 8; None keeps the exact range), then
  `choose_qparams`.  Float summation-order noise (torch's thread count changing a reduction order,
  ~1e-6 relative) then almost never reaches a scale: same inputs -> same quantized model.
- constants / weights and dynamic (per-batch) activations: the exact range (`compute_params`).
- zero ranges: `choose_qparams` gives s = eps; tiny ones keep their levels (s >= the smallest normal float32).
- flat ranges: where every consumer of a tensor is flat below L (Relu, Clip, hard-swish; found by the
  graph analysis `passes.flat_ranges`), the observer sees `clamp_for_observation(x, L)`.  Modules do
  not know their consumers, so the module API observes x itself.
- NaN / Inf: an observer raises DataError naming its tensor (or skips and counts them with
  `ignore_nonfinite=True`); graph PTQ also rejects non-finite calibration inputs up front.
"""

from __future__ import annotations

import torch

from netquant.calib.base import Observer
from netquant.core.qparams import QParams, choose_qparams
from netquant.errors import ConfigError

RANGE_MANTISSA_BITS = 8
"""Significant bits kept of an activation's calibrated range ends: the range widens by less than
2^-8 of itself (under one 8-bit step), and a 1e-6-relative perturbation moves it with probability
~1e-6 / 2^-9, i.e. rarely."""


def round_range_outward(lo: torch.Tensor, hi: torch.Tensor,
                        bits: int = RANGE_MANTISSA_BITS) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) rounded away from zero to `bits` significant bits: v = m * 2^e, m in [0.5, 1) ->
    sign(v) * ceil(|m| * 2^bits) * 2^(e - bits).  Zeros stay zero; the range only grows."""

    def away(v: torch.Tensor) -> torch.Tensor:
        v64 = v.double()
        mant, expo = torch.frexp(v64.abs())
        up = torch.ldexp(torch.ceil(torch.ldexp(mant, torch.full_like(expo, bits))), expo - bits)
        return (torch.sign(v64) * up).to(v.dtype)

    return away(lo), away(hi)


def activation_params(obs: Observer, bits: int | None = RANGE_MANTISSA_BITS) -> QParams:
    """Params of an activation observer from its range rounded outward to `bits` (None: as observed)."""
    if bits is None:
        return obs.compute_params()
    lo, hi = obs.range()
    lo, hi = round_range_outward(lo, hi, bits)
    return choose_qparams(lo, hi, obs.spec, name=obs.tensor_name)


def clamp_for_observation(x: torch.Tensor, lower: float) -> torch.Tensor:
    """max(x, lower') with lower' a little below `lower` (2 %, at least 1e-3), so the grid's lowest point
    stays <= lower: what an observer sees of a tensor whose consumers are all flat below `lower`."""
    margin = max(0.02 * abs(lower), 1e-3)
    return x.clamp(min=lower - margin)


def check_range_bits(range_bits: object, where: str) -> int | None:
    """`range_bits` if it is None or an int in [2, 52] (float64 mantissa), else ConfigError."""
    if range_bits is not None and (isinstance(range_bits, bool) or not isinstance(range_bits, int)
                                   or not 2 <= range_bits <= 52):
        raise ConfigError(f"{where}: range_bits must be None or an int in [2, 52], got {range_bits!r}")
    return range_bits
