"""NVIDIA pytorch-quantization style functions: amax in, scale = max_bound / amax.

    max_bound = 2^(bits - 1 + unsigned) - 1
    min_bound = 0 (unsigned), -max_bound (narrow_range), -max_bound - 1 (otherwise)
    q  = clamp(round_half_even(x * scale), min_bound, max_bound)
    x' = q / scale

Note the scale is the reciprocal of netquant's usual step size (s = amax / max_bound).
amax <= 2^-24 counts as zero: such values quantize to 0 and the returned scale is 1.
+-Inf inputs saturate to the bounds; NaN inputs stay NaN (as in pytorch-quantization).
Gradient: straight-through where |x| <= amax, 0 elsewhere; amax gets no gradient.
"""

from __future__ import annotations

import torch

from netquant.errors import ConfigError, DataError

_ZERO_AMAX = 1.0 / (1 << 24)


def _quant(x: torch.Tensor, amax: torch.Tensor | float, num_bits: int, unsigned: bool,
           narrow_range: bool, fn: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q as float32, returned scale, amax tensor) for tensor_quant / fake_tensor_quant."""
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise DataError(f"{fn}: input must be a floating torch.Tensor")
    if isinstance(num_bits, bool) or not isinstance(num_bits, int) or not 2 <= num_bits <= 16:
        raise ConfigError(f"{fn}: num_bits must be an int in [2, 16], got {num_bits!r}")
    amax_t = amax.detach() if isinstance(amax, torch.Tensor) else torch.tensor(float(amax))
    amax_t = amax_t.to(device=x.device, dtype=torch.float32)
    if amax_t.numel() == 0:
        raise DataError(f"{fn}: amax is empty; calibrate the quantizer first")
    if not bool(torch.isfinite(amax_t).all()):
        raise DataError(f"{fn}: amax contains NaN or Inf ({amax_t.flatten()[:4].tolist()}...); "
                        "recalibrate on finite data")
    min_amax = amax_t.min()
    if bool(min_amax < 0):
        raise DataError(f"{fn}: amax must be >= 0, got min {min_amax.item()}")
    xf = x.detach().to(torch.float32)
    if unsigned and xf.numel() and bool(xf.min() < 0):
        raise DataError(f"{fn}: negative values in unsigned quantization; use unsigned=False")
    max_bound = torch.tensor(2.0 ** (num_bits - 1 + int(unsigned)) - 1.0, device=x.device)
    min_bound = 0.0 if unsigned else (-max_bound.item() if narrow_range else -max_bound.item() - 1.0)
    scale = max_bound / amax_t
    zero = amax_t <= _ZERO_AMAX
    has_zero = bool(zero.any())
    if has_zero:
        scale = torch.where(zero, torch.zeros_like(scale), scale)
    q = torch.clamp((xf * scale).round_(), min_bound, max_bound.item())
    if has_zero:
        scale = torch.where(zero, torch.ones_like(scale), scale)
    return q, scale, amax_t


class _TensorQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, amax, num_bits, unsigned, narrow_range, fake):  # type: ignore[override]
        q, scale, amax_t = _quant(x, amax, num_bits, unsigned, narrow_range,
                                  "fake_tensor_quant" if fake else "tensor_quant")
        ctx.save_for_backward(x, amax_t)
        out = q / scale if fake else q
        out = out.to(x.dtype)
        if fake:
            return out
        ctx.mark_non_differentiable(scale)
        return out, scale

    @staticmethod
    def backward(ctx, grad, *_):  # type: ignore[override]
        x, amax_t = ctx.saved_tensors
        g = torch.where(x.abs() <= amax_t, grad, torch.zeros((), dtype=grad.dtype, device=grad.device))
        return g, None, None, None, None, None


def tensor_quant(x: torch.Tensor, amax: torch.Tensor | float, num_bits: int = 8, unsigned: bool = False,
                 narrow_range: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scale): q = clamp(round(x * scale), min_bound, max_bound) as a float tensor of integers
    (NVIDIA's convention), scale = max_bound / amax (broadcast with x)."""
    return _TensorQuant.apply(x, amax, num_bits, unsigned, narrow_range, False)


def fake_tensor_quant(x: torch.Tensor, amax: torch.Tensor | float, num_bits: int = 8, unsigned: bool = False,
                      narrow_range: bool = True) -> torch.Tensor:
    """x' = clamp(round(x * scale), min_bound, max_bound) / scale, scale = max_bound / amax."""
    return _TensorQuant.apply(x, amax, num_bits, unsigned, narrow_range, True)
