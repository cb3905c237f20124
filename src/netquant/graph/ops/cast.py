"""Cast / CastLike / BitCast, including float8 (saturating or not) and bfloat16."""

from __future__ import annotations

from typing import Any

import torch

from netquant.errors import UnsupportedOpError

from ._util import FLOAT8, TORCH_TO_ONNX, WIDE_UNSIGNED, onnx_dtype
from .registry import OpContext, register_op

Tensor = torch.Tensor

# Largest finite value of each float8 type (saturation bound).
_F8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e4m3fnuz: 240.0, torch.float8_e5m2: 57344.0,
           torch.float8_e5m2fnuz: 57344.0}


def to_float8(x: Tensor, dtype: torch.dtype, saturate: bool) -> Tensor:
    """Round-to-nearest-even cast to a float8 type.  saturate: out-of-range values, +-inf included, clamp
    to +-max; otherwise they become NaN (fn/fnuz) or inf (e5m2)."""
    xf = x.float() if x.dtype != torch.float64 else x
    if dtype == torch.float8_e8m0fnu:
        return xf.to(dtype)
    m = _F8_MAX[dtype]
    if saturate:
        return xf.clamp(-m, m).to(dtype)
    if dtype == torch.float8_e5m2:
        # torch already maps overflow to inf for e5m2; keep its rounding
        return xf.to(dtype)
    # types without inf: anything that rounds past max is NaN
    limit = {torch.float8_e4m3fn: 464.0, torch.float8_e4m3fnuz: 248.0, torch.float8_e5m2fnuz: 61440.0}[dtype]
    out = torch.where(xf.abs() >= limit, torch.full_like(xf, float("nan")), xf)
    return out.to(dtype)


def cast_to(x: Tensor, dtype: torch.dtype, saturate: bool = True) -> Tensor:
    if x.dtype == dtype:
        return x
    if dtype in FLOAT8:
        if x.dtype in FLOAT8:
            x = x.float()
        return to_float8(x, dtype, saturate)
    if x.dtype in FLOAT8:
        x = x.float()
    if dtype in WIDE_UNSIGNED and x.is_floating_point():
        return x.to(torch.int64).to(dtype)
    if dtype == torch.bool:
        return x != 0
    return x.to(dtype)


def _target(ctx: OpContext, attrs: dict[str, Any]) -> torch.dtype:
    to = attrs["to"]
    if isinstance(to, str):
        raise UnsupportedOpError(ctx.unsupported(f"to='{to}'"))
    if int(to) == 8:
        raise UnsupportedOpError(ctx.unsupported("string tensors"))
    return onnx_dtype(to, ctx, "target type")


@register_op("Cast")
def cast(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [cast_to(inputs[0], _target(ctx, attrs), bool(attrs.get("saturate", 1)))]


@register_op("CastLike")
def cast_like(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [cast_to(inputs[0], inputs[1].dtype, bool(attrs.get("saturate", 1)))]


@register_op("BitCast")
def bitcast(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Reinterpret the bits; same element size only (ONNX requires it)."""
    x = inputs[0]
    dt = _target(ctx, attrs)
    if x.dtype == torch.bool or dt == torch.bool:
        return [x.to(torch.uint8).view(dt) if x.dtype == torch.bool else x.view(torch.uint8).bool()]
    if x.element_size() != torch.empty(0, dtype=dt).element_size():
        raise UnsupportedOpError(ctx.unsupported(f"bit cast {x.dtype} -> {dt} with different element sizes"))
    return [x.view(dt)]


__all__ = ["cast_to", "to_float8", "TORCH_TO_ONNX"]
