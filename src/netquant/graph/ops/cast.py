"""Cast / CastLike / BitCast, including float8 (saturating or not) and bfloat16."""

from __future__ import annotations

from typing import Any

import torch
from onnx import TensorProto

from netquant.errors import UnsupportedOpError
from netquant.graph.dtypes import COMPUTED_STAND_IN, SUB_BYTE_RANGE, TORCH_TO_ONNX

from ._util import (
    FLOAT8,
    WIDE_UNSIGNED,
    elem_type_of,
    onnx_dtype,
    widen,
)
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
        return to_e8m0(xf, saturate, "up")
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


def to_e8m0(x: Tensor, saturate: bool, round_mode: str) -> Tensor:
    """Power-of-two scale type: keep the float32 exponent, rounding the mantissa up / down / to nearest."""
    bits = x.float().view(torch.int32)
    exp = (bits >> 23) & 0xFF
    special = exp == 0xFF
    if round_mode == "nearest":
        g = (bits & 0x400000) != 0
        r = (bits & 0x200000) != 0
        st = (bits & 0x1FFFFF) != 0
        up = g & (r | st | (exp > 0)) & ~special
    elif round_mode == "up":
        up = ((bits & 0x7FFFFF) != 0) & ~special
    elif round_mode == "down":
        up = torch.zeros_like(special)
    else:
        raise UnsupportedOpError(f"Cast: round_mode '{round_mode}' is not supported")
    if saturate:
        up = up & (exp != 0xFE)
    exp = torch.where(special, torch.full_like(exp, 0xFF), (exp + up.to(exp.dtype)) & 0xFF)
    return exp.to(torch.uint8).view(torch.float8_e8m0fnu)


_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_EVEN = (True, False, True, False, True, False, True, False)  # even mantissa wins ties


def to_float4_e2m1(x: Tensor) -> Tensor:
    """Round to the nearest FLOAT4E2M1 value (ties to even mantissa), saturating at +-6; returned in
    float32 (the stand-in dtype).  NaN -> -0 and +-inf -> +-6, as ml_dtypes / the ONNX reference do."""
    xf = x.float()
    grid = torch.tensor(_E2M1_GRID, device=x.device)
    even = torch.tensor(_E2M1_EVEN, device=x.device)
    a = xf.abs().nan_to_num(nan=0.0, posinf=6.0).clamp(max=6.0)
    hi_i = torch.searchsorted(grid, a.contiguous()).clamp(1, len(_E2M1_GRID) - 1)
    lo_i = hi_i - 1
    lo, hi = grid[lo_i], grid[hi_i]
    d_lo, d_hi = a - lo, hi - a
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & even[hi_i])
    mag = torch.where(pick_hi, hi, lo)
    out = torch.where(torch.signbit(xf), -mag, mag)
    return torch.where(torch.isnan(xf), torch.full_like(xf, -0.0), out)


def to_sub_byte(x: Tensor, elem_type: int) -> Tensor:
    """Cast to a sub-byte ONNX type (value in its stand-in dtype): integers truncate toward zero and wrap
    modulo 2^bits (NaN/inf -> 0), as numpy's astype to ml_dtypes int4 / uint4 / int2 / uint2 does."""
    if elem_type == TensorProto.FLOAT4E2M1:
        return to_float4_e2m1(x.float() if x.dtype in FLOAT8 else x)
    lo, hi = SUB_BYTE_RANGE[elem_type]
    span = hi - lo + 1
    if x.is_floating_point():
        xf = x.double()
        xf = torch.where(torch.isfinite(xf), torch.trunc(xf), torch.zeros_like(xf))
        t = xf.to(torch.int64)
    else:
        t = widen(x).to(torch.int64)
    return (torch.remainder(t - lo, span) + lo).to(COMPUTED_STAND_IN[elem_type])


def cast_to(x: Tensor, dtype: torch.dtype, saturate: bool = True, round_mode: str = "up") -> Tensor:
    if x.dtype == dtype:
        return x
    if dtype == torch.float8_e8m0fnu:
        return to_e8m0(x.float() if x.dtype in FLOAT8 else x, saturate, round_mode)
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


def _to_code(to: Any, ctx: OpContext) -> int:
    """Cast-1 names the type as a string ("FLOAT"); later opsets use the TensorProto code."""
    if isinstance(to, str):
        import onnx

        try:
            return int(onnx.TensorProto.DataType.Value(to.upper()))
        except ValueError:
            raise UnsupportedOpError(ctx.unsupported(f"to='{to}'")) from None
    return int(to)


def _target(ctx: OpContext, attrs: dict[str, Any]) -> torch.dtype:
    to = _to_code(attrs["to"], ctx)
    if int(to) == 8:
        raise UnsupportedOpError(ctx.unsupported("string tensors"))
    return onnx_dtype(to, ctx, "target type")


@register_op("Cast")
def cast(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    to = _to_code(attrs["to"], ctx)
    if to in COMPUTED_STAND_IN:
        return [to_sub_byte(inputs[0], to)]
    return [cast_to(inputs[0], _target(ctx, attrs), bool(attrs.get("saturate", 1)), attrs.get("round_mode", "up"))]


@register_op("CastLike")
def cast_like(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    target = elem_type_of(ctx, "input", 1)
    if target in COMPUTED_STAND_IN:
        return [to_sub_byte(inputs[0], target)]
    return [cast_to(inputs[0], inputs[1].dtype, bool(attrs.get("saturate", 1)), attrs.get("round_mode", "up"))]


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
