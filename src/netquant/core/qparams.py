"""Choosing scale and zero point from an observed range (torch.ao.quantization's formulas).

    affine:      min' = min(min, 0), max' = max(max, 0)
                 s = max((max' - min') / (qmax - qmin), eps)
                 z = clamp(qmin - round(min' / s), qmin, qmax)
    symmetric:   amax = max(-min', max'); s = max(amax / ((qmax - qmin) / 2), eps)
                 z = 0 (signed) or (qmin + qmax + 1) // 2 (unsigned; 128 for uint8, as torch.ao)
    fp8:         s = max(amax / fp_max, eps), z = 0
    power of two: s = 2^ceil(log2(s)) (exact, via frexp), applied before z is computed.

Zero range (min == max == 0, or any range below eps * (qmax - qmin)) gives s = eps
(float32 machine epsilon, torch.ao's convention): never 0, NaN or Inf.
NaN or Inf in min/max raises DataError; a never-observed range (min > max, e.g. the observer's
initial +inf/-inf) raises CalibrationError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from netquant.core.spec import QuantSpec, ScaleConstraint
from netquant.errors import CalibrationError, DataError

EPS = torch.finfo(torch.float32).eps


@dataclass(frozen=True)
class QParams:
    """Scale (float32) and zero point (int32), same shape.

    Shape () per-tensor, (C,) per-channel, and for per-group the tensor's shape with dim `axis`
    replaced by the number of groups. The zero point is 0 for FP8 and signed symmetric specs.
    """

    scale: torch.Tensor
    zero_point: torch.Tensor

    def __post_init__(self) -> None:
        if self.scale.shape != self.zero_point.shape:
            raise DataError(f"QParams: scale shape {tuple(self.scale.shape)} != zero_point shape "
                            f"{tuple(self.zero_point.shape)}; give one zero point per scale")


def _as_tensor(v: torch.Tensor | float, name: str) -> torch.Tensor:
    t = v.detach() if isinstance(v, torch.Tensor) else torch.tensor(float(v))
    return t.to(torch.float32)


def pow2_ceil(scale: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(s)) for s > 0, exactly (no log2 rounding error)."""
    mantissa, exponent = torch.frexp(scale)  # s = m * 2^e, m in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(scale), exponent)


def choose_qparams(min_val: torch.Tensor | float, max_val: torch.Tensor | float, spec: QuantSpec,
                   name: str = "tensor") -> QParams:
    """Scale and zero point covering [min_val, max_val] under `spec` (see module docstring).

    `name` is used in error messages (e.g. the graph tensor being calibrated).
    """
    lo = _as_tensor(min_val, name)
    hi = _as_tensor(max_val, name).to(lo.device)
    if lo.shape != hi.shape:
        raise DataError(f"choose_qparams({name}): min shape {tuple(lo.shape)} != max shape {tuple(hi.shape)}")
    if lo.numel() == 0:
        raise CalibrationError(f"choose_qparams({name}): empty min/max; observe some data first")
    if (lo > hi).any():
        raise CalibrationError(
            f"choose_qparams({name}): min > max (range never observed); run calibration data through "
            f"{name} before choosing its quantization params")
    if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
        raise DataError(
            f"choose_qparams({name}): observed range contains NaN or Inf (min={lo.min().item()}, "
            f"max={hi.max().item()}); clean the input data or clip it before calibration")
    zero = torch.zeros_like(lo)
    min_neg = torch.minimum(lo, zero)
    max_pos = torch.maximum(hi, zero)
    qmin, qmax = spec.qmin, spec.qmax
    eps = torch.tensor(EPS, dtype=torch.float32, device=lo.device)
    pow2 = spec.scale_constraint is ScaleConstraint.POWER_OF_TWO

    if spec.is_float:
        amax = torch.maximum(-min_neg, max_pos)
        scale = torch.maximum(amax / spec.fp_max, eps)
        if pow2:
            scale = pow2_ceil(scale)
        zp = torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)
    elif spec.symmetric:
        amax = torch.maximum(-min_neg, max_pos)
        scale = torch.maximum(amax / (float(qmax - qmin) / 2), eps)
        if pow2:
            scale = pow2_ceil(scale)
        mid = 0 if spec.signed else (qmin + qmax + 1) // 2
        zp = torch.full(scale.shape, mid, dtype=torch.int32, device=scale.device)
    else:
        scale = torch.maximum((max_pos - min_neg) / float(qmax - qmin), eps)
        if pow2:
            scale = pow2_ceil(scale)
        zp = qmin - torch.round(min_neg / scale).to(torch.int32)
        zp = torch.clamp(zp, qmin, qmax).to(torch.int32)
    return QParams(scale=scale.to(torch.float32), zero_point=zp)
