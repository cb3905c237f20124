"""Quantisation ops: QuantizeLinear / DequantizeLinear (per tensor, per axis, blocked; int and float8),
DynamicQuantizeLinear, MatMulInteger, QLinearMatMul, QLinearConv and com.microsoft QLinear element-wise ops.

    q = saturate(round_half_even(x / scale) + zero_point)        x = (q - zero_point) * scale
"""

from __future__ import annotations

from typing import Any

import torch
from onnx import TensorProto

from netquant.core.int_kernels import (
    Accumulation,
    LayoutKind,
    WeightLayout,
    conv_pairwise_correction,
    pairwise_correction,
)
from netquant.errors import UnsupportedOpError
from netquant.graph.dtypes import COMPUTED_STAND_IN, SUB_BYTE_RANGE

from ._util import FLOAT8, axis_of, broadcast_shape, elem_type_of, onnx_dtype, opt
from .cast import to_float4_e2m1, to_float8
from .conv import conv_nd, resolve_pads
from .registry import OpContext, register_op

Tensor = torch.Tensor

_INT_RANGE = {torch.uint8: (0, 255), torch.int8: (-128, 127), torch.uint16: (0, 65535),
              torch.int16: (-32768, 32767), torch.int32: (-2**31, 2**31 - 1)}

MS = "com.microsoft"


def broadcast_param(p: Tensor, x: Tensor, axis: int, block_size: int) -> Tensor:
    """A scale / zero point shaped to broadcast against x: scalar, per-axis vector or blocked tensor."""
    if p.numel() == 1 and block_size == 0:
        return p.reshape(())
    a = axis_of(axis, x.dim())
    if block_size > 0:
        return p.repeat_interleave(block_size, dim=a).narrow(a, 0, x.shape[a])
    shape = [1] * x.dim()
    shape[a] = p.numel()
    return p.reshape(shape)


def quantize(x: Tensor, scale: Tensor, zp: Tensor | None, dtype: torch.dtype, saturate: bool = True,
             elem_type: int | None = None) -> Tensor:
    """q = saturate(round(x / scale) + zp) for an integer dtype, or x / scale cast to a float8 dtype.
    elem_type: a sub-byte ONNX type (INT4, UINT4, INT2, UINT2, FLOAT4E2M1) held in its stand-in dtype."""
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    v = x.to(compute) / scale.to(compute)
    if elem_type == TensorProto.FLOAT4E2M1:
        return to_float4_e2m1(v)
    if dtype in FLOAT8:
        return to_float8(v, dtype, saturate)
    if elem_type in SUB_BYTE_RANGE:
        lo, hi = SUB_BYTE_RANGE[elem_type]
        dtype = COMPUTED_STAND_IN[elem_type]
    elif dtype not in _INT_RANGE:
        raise UnsupportedOpError(f"QuantizeLinear: output type {dtype} is not supported")
    else:
        lo, hi = _INT_RANGE[dtype]
    q = torch.round(v)
    if zp is not None:
        q = q + zp.to(compute)
    return q.clamp(lo, hi).to(dtype)


def dequantize(q: Tensor, scale: Tensor, zp: Tensor | None) -> Tensor:
    if q.dtype in FLOAT8 or q.is_floating_point():
        return q.to(scale.dtype) * scale
    v = q.to(torch.int32) if q.dtype != torch.int32 else q
    if zp is not None:
        v = v - zp.to(torch.int32)
    return v.to(scale.dtype) * scale


@register_op("QuantizeLinear")
def quantize_linear(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, scale, zp = inputs[0], inputs[1], opt(inputs, 2)
    axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
    elem = elem_type_of(ctx, "output", 0)
    if zp is not None:
        dtype = zp.dtype
        elem = elem_type_of(ctx, "input", 2) or elem
    elif attrs.get("output_dtype"):
        elem = int(attrs["output_dtype"])
        dtype = COMPUTED_STAND_IN[elem] if elem in COMPUTED_STAND_IN else onnx_dtype(elem, ctx, "output_dtype")
    else:
        dtype = torch.uint8
    if elem not in COMPUTED_STAND_IN:
        elem = None
    if elem is None and dtype not in _INT_RANGE and dtype not in FLOAT8:
        raise UnsupportedOpError(ctx.unsupported(f"output type {dtype}"))
    s = broadcast_param(scale, x, axis, block)
    z = broadcast_param(zp, x, axis, block) if zp is not None and dtype not in FLOAT8 and \
        elem != TensorProto.FLOAT4E2M1 else None
    return [quantize(x, s, z, dtype, bool(attrs.get("saturate", 1)), elem)]


@register_op("DequantizeLinear")
def dequantize_linear(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    q, scale, zp = inputs[0], inputs[1], opt(inputs, 2)
    axis, block = attrs.get("axis", 1), attrs.get("block_size", 0)
    s = broadcast_param(scale, q, axis, block)
    z = broadcast_param(zp, q, axis, block) if zp is not None and q.dtype not in FLOAT8 else None
    y = dequantize(q, s, z)
    if attrs.get("output_dtype"):
        y = y.to(onnx_dtype(attrs["output_dtype"], ctx, "output_dtype"))
    return [y]


@register_op("DynamicQuantizeLinear")
def dynamic_quantize_linear(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """scale = (max(0, max x) - min(0, min x)) / 255; zp = saturate(round(-min / scale)); uint8 output."""
    x = inputs[0]
    lo = torch.clamp(x.min(), max=0.0)
    hi = torch.clamp(x.max(), min=0.0)
    scale = (hi - lo) / 255.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    zp = torch.round(-lo / safe).clamp(0, 255)
    y = (torch.round(x / safe) + zp).clamp(0, 255).to(torch.uint8)
    return [y, scale.to(x.dtype), zp.to(torch.uint8)]


def _zp_sub(x: Tensor, zp: Tensor | None, axis_shape: list[int] | None = None) -> Tensor:
    v = x.to(torch.float64)
    if zp is not None:
        z = zp.to(torch.float64)
        if axis_shape is not None and z.numel() > 1:
            z = z.reshape(axis_shape)
        v = v - z
    return v


def saturating_kernel(ctx: OpContext, a: Tensor, b: Tensor) -> bool:
    """True when this executor emulates a pairwise-int16 kernel and the op is u8 x s8 (see core.int_kernels)."""
    return (ctx.extras.get("accumulation", Accumulation.EXACT) is Accumulation.PAIRWISE_INT16
            and a.dtype == torch.uint8 and b.dtype == torch.int8)


def matmul_saturation(a: Tensor, b: Tensor, layout: LayoutKind = LayoutKind.ROWS) -> Tensor:
    """Saturation term of raw codes a [..., M, K] times b ([..., K, N], or [N, K] for COLS)."""
    if b.dim() <= 2:
        return pairwise_correction(a, WeightLayout(layout).to_nk(b))
    lead = broadcast_shape(a.shape[:-2], b.shape[:-2])
    a_b, b_b = a.expand(*lead, *a.shape[-2:]), b.expand(*lead, *b.shape[-2:])
    parts = [pairwise_correction(x, WeightLayout(layout).to_nk(w))
             for x, w in zip(a_b.reshape(-1, *a.shape[-2:]), b_b.reshape(-1, *b.shape[-2:]))]
    return torch.stack(parts).reshape(*lead, a.shape[-2], -1)


@register_op("MatMulInteger")
def matmul_integer(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """int32 y = (a - a_zp) @ (b - b_zp); a_zp per row (M) or scalar, b_zp per column (N) or scalar."""
    a, b, az, bz = inputs[0], inputs[1], opt(inputs, 2), opt(inputs, 3)
    av = _zp_sub(a, az, [-1, 1])
    bv = _zp_sub(b, bz, [1, -1])
    acc = torch.matmul(av, bv)
    if saturating_kernel(ctx, a, b):
        acc = acc + matmul_saturation(a, b)
    return [acc.round().to(torch.int32)]


def _requant(acc: Tensor, multiplier: Tensor, yz: Tensor | None, dtype: torch.dtype) -> Tensor:
    lo, hi = _INT_RANGE[dtype]
    y = torch.round(acc * multiplier)
    if yz is not None:
        y = y + yz.to(y.dtype)
    return y.clamp(lo, hi).to(dtype)


@register_op("QLinearMatMul")
def qlinear_matmul(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = saturate(round((a - az) @ (b - bz) * (as * bs / ys)) + yz); exact integer accumulation, float32
    multiplier (as onnxruntime); scales per tensor, per row of a or per column of b."""
    a, a_s, a_z, b, b_s, b_z, y_s, y_z = inputs[:8]
    acc = torch.matmul(_zp_sub(a, a_z, [-1, 1]), _zp_sub(b, b_z, [1, -1]))
    if saturating_kernel(ctx, a, b):
        acc = acc + matmul_saturation(a, b)
    sa = a_s.float().reshape(-1, 1) if a_s.numel() > 1 else a_s.float().reshape(())
    sb = b_s.float().reshape(1, -1) if b_s.numel() > 1 else b_s.float().reshape(())
    y_dtype = y_z.dtype if y_z is not None else torch.uint8
    if y_dtype in FLOAT8:
        return [to_float8(acc * (sa * sb).double() / y_s.double(), y_dtype, True)]
    return [_requant(acc.float(), sa * sb / y_s.float(), y_z, y_dtype)]


@register_op("QLinearConv")
def qlinear_conv(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = saturate(round((conv(x - xz, w - wz) + B) * xs * ws / ys) + yz), w quantised per output channel."""
    x, xs, xz, w, ws, wz, ys, yz = inputs[:8]
    bias = opt(inputs, 8)
    xv = _zp_sub(x, xz)
    wshape = [-1] + [1] * (w.dim() - 1)
    wv = _zp_sub(w, wz, wshape)
    acc = conv_nd(xv, wv, None, attrs, ctx)
    group = int(attrs.get("group", 1))
    depthwise = w.shape[1] == 1 and w.shape[0] == group  # onnxruntime's depthwise kernel: exact products
    if saturating_kernel(ctx, x, w) and not depthwise:
        nd = x.dim() - 2
        kernel = [int(k) for k in attrs.get("kernel_shape", w.shape[2:])]
        strides = [int(v) for v in attrs.get("strides", [1] * nd)]
        dil = [int(v) for v in attrs.get("dilations", [1] * nd)]
        pads = resolve_pads(attrs, list(x.shape[2:]), kernel, strides, dil, ctx)
        zp = float(xz.reshape(-1)[0]) if xz is not None else 0.0
        acc = acc + conv_pairwise_correction(x, w, group=group, strides=strides, dilations=dil, pads=pads,
                                             pad_value=zp)
    if bias is not None:
        acc = acc + bias.double().reshape(1, -1, *([1] * (acc.dim() - 2)))
    mult = xs.double() * ws.double()
    if mult.numel() > 1:
        mult = mult.reshape(1, -1, *([1] * (acc.dim() - 2)))
    return [_requant(acc, mult / ys.double(), yz, yz.dtype if yz is not None else x.dtype)]


# ---------------------------------------------------------------- com.microsoft QLinear element-wise ops
def _dq(x: Tensor, s: Tensor, z: Tensor | None) -> Tensor:
    return dequantize(x, s.float(), z)


def _q(y: Tensor, s: Tensor, z: Tensor | None, like: Tensor) -> Tensor:
    return quantize(y, s.float(), z, z.dtype if z is not None else like.dtype)


def _centered(x: Tensor, z: Tensor | None) -> Tensor:
    v = x.to(torch.float32)
    return v - z.to(torch.float32) if z is not None else v


def _requant_float(v: Tensor, cz: Tensor | None, like: Tensor) -> Tensor:
    dtype = cz.dtype if cz is not None else like.dtype
    lo, hi = _INT_RANGE[dtype]
    y = torch.sign(v) * torch.floor(v.abs() + 0.5)  # onnxruntime's contrib kernels round half away from 0
    y = y + (cz.to(torch.float32) if cz is not None else 0.0)
    return y.clamp(lo, hi).to(dtype)


@register_op("QLinearAdd", domain=MS)
def qlinear_add(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """c = saturate(round((a - az) * as / cs + (b - bz) * bs / cs) + cz), float32 scale ratios and
    round-half-away-from-zero, as onnxruntime's kernel (the op's reference) computes it."""
    a, a_s, a_z, b, b_s, b_z, c_s, c_z = (list(inputs) + [None] * 8)[:8]
    ra, rb = (a_s.float() / c_s.float()), (b_s.float() / c_s.float())
    return [_requant_float(_centered(a, a_z) * ra + _centered(b, b_z) * rb, c_z, a)]


@register_op("QLinearMul", domain=MS)
def qlinear_mul(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """c = saturate(round((a - az) * (b - bz) * as * bs / cs) + cz)."""
    a, a_s, a_z, b, b_s, b_z, c_s, c_z = (list(inputs) + [None] * 8)[:8]
    ratio = a_s.float() * b_s.float() / c_s.float()
    return [_requant_float(_centered(a, a_z) * _centered(b, b_z) * ratio, c_z, a)]


def _qlinear_unary(op_type: str, fn) -> None:
    @register_op(op_type, domain=MS)
    def impl(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        x, xs, xz, ys, yz = (list(inputs) + [None] * 5)[:5]
        return [_q(fn(_dq(x, xs, xz), attrs), ys, yz, x)]

    impl.__name__ = op_type.lower()


_qlinear_unary("QLinearSigmoid", lambda v, a: torch.sigmoid(v))
_qlinear_unary("QLinearLeakyRelu", lambda v, a: torch.nn.functional.leaky_relu(v, a.get("alpha", 0.01)))
_qlinear_unary("QLinearGlobalAveragePool",
               lambda v, a: v.mean(dim=tuple(range(1, v.dim() - 1)), keepdim=True) if a.get("channels_last", 0)
               else v.mean(dim=tuple(range(2, v.dim())), keepdim=True))


@register_op("QLinearConcat", domain=MS)
def qlinear_concat(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    ys, yz = inputs[0], inputs[1]
    parts = [_dq(inputs[i], inputs[i + 1], inputs[i + 2]) for i in range(2, len(inputs), 3)]
    return [_q(torch.cat(parts, dim=attrs["axis"]), ys, yz, inputs[2])]


__all__ = ["quantize", "dequantize", "broadcast_param"]


def _per_column(s: Tensor) -> Tensor:
    return s.reshape(1, -1) if s.numel() > 1 else s.reshape(())


@register_op("QGemm", domain=MS)
def qgemm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Y = alpha * (A - az)'(B - bz)' * as * bs + C * as * bs (C int32); requantised when y_scale is given."""
    a, a_s, a_z, b, b_s, b_z = inputs[:6]
    c, y_s, y_z = opt(inputs, 6), opt(inputs, 7), opt(inputs, 8)
    av = _zp_sub(a, a_z)
    bz = b_z.to(torch.float64) if b_z is not None else None
    if attrs.get("transB", 0):
        bv = b.to(torch.float64) - (bz.reshape(-1, 1) if bz is not None and bz.numel() > 1 else
                                    (bz if bz is not None else 0))
        bv = bv.t()
    else:
        bv = b.to(torch.float64) - (_per_column(bz) if bz is not None else 0)
    if attrs.get("transA", 0):
        av = av.t()
    acc = torch.matmul(av, bv)
    if saturating_kernel(ctx, a, b):
        a_raw = a.t() if attrs.get("transA", 0) else a
        acc = acc + matmul_saturation(a_raw, b, LayoutKind.COLS if attrs.get("transB", 0) else LayoutKind.ROWS)
    acc = acc * attrs.get("alpha", 1.0)
    if c is not None:
        acc = acc + c.to(torch.float64)
    mult = a_s.float().reshape(()) * _per_column(b_s.float())
    if y_s is None:
        return [acc.float() * mult]
    # float32 requantisation multiplier, as onnxruntime's kernel applies it
    return [_requant(acc.float(), mult / y_s.float(), y_z, y_z.dtype if y_z is not None else a.dtype)]


@register_op("MatMulIntegerToFloat", domain=MS)
def matmul_integer_to_float(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Y = (A - az) @ (B - bz) * as * bs + bias, float output (scales per tensor or per column of B)."""
    a, b, a_s, b_s = inputs[:4]
    a_z, b_z, bias = opt(inputs, 4), opt(inputs, 5), opt(inputs, 6)
    acc = torch.matmul(_zp_sub(a, a_z), b.to(torch.float64) - (_per_column(b_z.double()) if b_z is not None
                                                                else 0))
    if saturating_kernel(ctx, a, b):
        acc = acc + matmul_saturation(a, b)
    y = (acc * (a_s.double().reshape(()) * _per_column(b_s.double()))).to(a_s.dtype)
    return [y + bias if bias is not None else y]


@register_op("DynamicQuantizeMatMul", domain=MS)
def dynamic_quantize_matmul(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """A is quantised to uint8 on the fly (DynamicQuantizeLinear), then MatMulIntegerToFloat."""
    a, b, b_s = inputs[:3]
    b_z, bias = opt(inputs, 3), opt(inputs, 4)
    qa, a_s, a_z = dynamic_quantize_linear([a], {}, ctx)
    return matmul_integer_to_float([qa, b, a_s, b_s, a_z, b_z, bias], {}, ctx)


@register_op("QLinearAveragePool", domain=MS)
def qlinear_average_pool(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    from .pool import average_pool

    """Average of (x - xz) (exact integers in float32), times xs / ys, rounded half to even, + yz."""
    x, xs, xz, ys, yz = (list(inputs) + [None] * 5)[:5]
    v = _centered(x, xz)
    if attrs.get("channels_last", 0):
        v = v.movedim(-1, 1)
    y = average_pool([v], {k: a for k, a in attrs.items() if k != "channels_last"}, ctx)[0]
    if attrs.get("channels_last", 0):
        y = y.movedim(1, -1)
    dtype = yz.dtype if yz is not None else x.dtype
    lo, hi = _INT_RANGE[dtype]
    q = torch.round(y * (xs.float() / ys.float())) + (yz.float() if yz is not None else 0.0)
    return [q.clamp(lo, hi).to(dtype)]


@register_op("QLinearSoftmax", domain=MS)
def qlinear_softmax(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """softmax of the dequantised input (opset attribute picks the legacy 2-D or per-axis semantics)."""
    x, xs, xz, ys, yz = (list(inputs) + [None] * 5)[:5]
    v = _dq(x, xs, xz)
    axis = attrs.get("axis", -1)
    if attrs.get("opset", 13) < 13:
        lead = int(torch.tensor(v.shape[: axis % v.dim()]).prod()) if axis % v.dim() else 1
        y = torch.softmax(v.reshape(lead, -1), 1).reshape(v.shape)
    else:
        y = torch.softmax(v, axis)
    return [_q(y, ys, yz, x)]
