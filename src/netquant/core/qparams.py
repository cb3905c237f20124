"""Choosing scale and zero point from an observed range (torch.ao.quantization's formulas).

    affine:      min' = min(min, 0), max' = max(max, 0)
                 s = floor((max' - min') / (qmax - qmin))
                 z = clamp(qmin - round(min' / s), qmin, qmax)
    symmetric:   amax = max(-min', max'); s = floor(amax / ((qmax - qmin) / 2))
                 z = 0 (signed) or (qmin + qmax + 1) // 2 (unsigned; 128 for uint8, as torch.ao)
    fp8:         s = floor(amax / fp_max), z = 0
    power of two: s = 2^ceil(log2(s)) (exact, via frexp), applied before z is computed.

The floor is relative to the tensor: floor(r) = max(r, TINY) for r > 0, so a tensor of magnitude 1e-8 keeps all
its levels (torch.ao's absolute floor, float32 eps = 1.19e-7, would code it as zero); TINY is the smallest normal
float32 (1.18e-38), the smallest scale onnxruntime and the other engines take without denormals. A zero range
(min == max == 0) gives s = eps (float32 machine epsilon, torch.ao's convention: any scale codes zero exactly,
and eps keeps products such as a bias scale s_in * s_w normal). Never 0, NaN or Inf.
NaN or Inf in min/max raises DataError; a never-observed range (min > max, e.g. the observer's
initial +inf/-inf) raises CalibrationError.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from netquant.core.spec import QuantSpec, ScaleConstraint
from netquant.errors import CalibrationError, DataError

EPS = torch.finfo(torch.float32).eps  # the scale of a zero range
TINY = torch.finfo(torch.float32).tiny  # 2**-126, the smallest normal float32: the least scale of a non-zero range


def scale_floor(raw: torch.Tensor) -> torch.Tensor:
    """raw (range / levels) floored relative to the tensor: max(raw, TINY) where raw > 0, EPS where the range is 0."""
    return torch.where(raw > 0, torch.clamp(raw, min=TINY), torch.full_like(raw, EPS))


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
    pow2 = spec.scale_constraint is ScaleConstraint.POWER_OF_TWO

    if spec.is_float:
        amax = torch.maximum(-min_neg, max_pos)
        scale = scale_floor(amax / spec.fp_max)
        if pow2:
            scale = pow2_ceil(scale)
        zp = torch.zeros(scale.shape, dtype=torch.int32, device=scale.device)
    elif spec.symmetric:
        amax = torch.maximum(-min_neg, max_pos)
        scale = scale_floor(amax / (float(qmax - qmin) / 2))
        if pow2:
            scale = pow2_ceil(scale)
        mid = 0 if spec.signed else (qmin + qmax + 1) // 2
        zp = torch.full(scale.shape, mid, dtype=torch.int32, device=scale.device)
    else:
        scale = scale_floor((max_pos - min_neg) / float(qmax - qmin))
        if pow2:
            scale = pow2_ceil(scale)
        zp = qmin - torch.round(min_neg / scale).to(torch.int32)
        zp = torch.clamp(zp, qmin, qmax).to(torch.int32)
    return QParams(scale=scale.to(torch.float32), zero_point=zp)
