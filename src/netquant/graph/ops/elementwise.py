"""Element-wise ONNX ops: unary math, binary arithmetic (numpy broadcasting), comparisons and logic.

ONNX has no implicit type promotion: both operands share a dtype and the output keeps it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from netquant.errors import UnsupportedOpError

from ._util import WIDE_UNSIGNED, widen
from .registry import OpContext, register_op

Tensor = torch.Tensor


def _unary(op_type: str, fn: Callable[[Tensor], Tensor]) -> None:
    @register_op(op_type)
    def impl(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        x = inputs[0]
        if x.dtype in WIDE_UNSIGNED:
            return [fn(widen(x)).to(x.dtype)]
        return [fn(x)]

    impl.__name__ = op_type.lower()


for _name, _fn in {
    "Abs": torch.abs, "Neg": torch.neg, "Ceil": torch.ceil, "Floor": torch.floor, "Round": torch.round,
    "Sqrt": torch.sqrt, "Exp": torch.exp, "Log": torch.log, "Reciprocal": torch.reciprocal,
    "Sin": torch.sin, "Cos": torch.cos, "Tan": torch.tan, "Asin": torch.asin, "Acos": torch.acos,
    "Atan": torch.atan, "Sinh": torch.sinh, "Cosh": torch.cosh, "Asinh": torch.asinh, "Acosh": torch.acosh,
    "Atanh": torch.atanh, "Erf": torch.erf, "Sign": torch.sign, "Not": torch.logical_not,
    "BitwiseNot": torch.bitwise_not, "IsNaN": torch.isnan,
}.items():
    _unary(_name, _fn)


@register_op("IsInf")
def isinf(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    neg, pos = attrs.get("detect_negative", 1), attrs.get("detect_positive", 1)
    if neg and pos:
        return [torch.isinf(x)]
    if pos:
        return [torch.isposinf(x)]
    if neg:
        return [torch.isneginf(x)]
    return [torch.zeros_like(x, dtype=torch.bool)]


def _binary(op_type: str, fn: Callable[[Tensor, Tensor], Tensor], *, bool_out: bool = False) -> None:
    @register_op(op_type)
    def impl(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        a, b = inputs[0], inputs[1]
        if a.dtype in WIDE_UNSIGNED:
            out = fn(widen(a), widen(b))
            return [out if bool_out else out.to(a.dtype)]
        return [fn(a, b)]

    impl.__name__ = op_type.lower()


def _div(a: Tensor, b: Tensor) -> Tensor:
    if a.is_floating_point() or a.is_complex():
        return a / b
    return torch.div(a, b, rounding_mode="trunc")


for _name, _fn in {
    "Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": _div,
    "BitwiseAnd": torch.bitwise_and, "BitwiseOr": torch.bitwise_or, "BitwiseXor": torch.bitwise_xor,
}.items():
    _binary(_name, _fn)

for _name, _fn in {
    "Equal": torch.eq, "Greater": torch.gt, "GreaterOrEqual": torch.ge, "Less": torch.lt,
    "LessOrEqual": torch.le, "And": torch.logical_and, "Or": torch.logical_or, "Xor": torch.logical_xor,
}.items():
    _binary(_name, _fn, bool_out=True)


@register_op("Pow")
def pow_(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Z = X ** Y; Z has X's dtype (Y may differ)."""
    x, y = inputs[0], inputs[1]
    if x.is_floating_point():
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        return [torch.pow(x, y)]
    if y.is_floating_point():
        return [torch.pow(x.to(torch.float64), y.to(torch.float64)).to(x.dtype)]
    return [torch.pow(widen(x), widen(y).to(torch.int64)).to(x.dtype)]


@register_op("Mod")
def mod(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """fmod=0: result takes the divisor's sign (python %); fmod=1: C fmod (dividend's sign)."""
    a, b = inputs[0], inputs[1]
    fmod = attrs.get("fmod", 0)
    aw, bw = widen(a), widen(b)
    out = torch.fmod(aw, bw) if fmod else torch.remainder(aw, bw)
    return [out.to(a.dtype)]


@register_op("BitShift")
def bitshift(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, y = inputs[0], inputs[1]
    direction = attrs.get("direction", "")
    xw, yw = widen(x), widen(y)
    if direction == "LEFT":
        out = torch.bitwise_left_shift(xw, yw)
    elif direction == "RIGHT":
        out = torch.bitwise_right_shift(xw, yw)
    else:
        raise UnsupportedOpError(ctx.unsupported(f"direction '{direction}'"))
    return [out.to(x.dtype)]


def _variadic(op_type: str, fn: Callable[[Tensor, Tensor], Tensor], finish: Callable | None = None) -> None:
    @register_op(op_type)
    def impl(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        xs = [x for x in inputs if x is not None]
        dt = xs[0].dtype
        acc = widen(xs[0])
        for x in xs[1:]:
            acc = fn(acc, widen(x))
        if finish is not None:
            acc = finish(acc, len(xs))
        return [acc.to(dt) if acc.dtype != dt else acc]

    impl.__name__ = op_type.lower()


_variadic("Sum", torch.add)
_variadic("Max", torch.maximum)
_variadic("Min", torch.minimum)
_variadic("Mean", torch.add, lambda acc, n: acc / n)


@register_op("Where")
def where(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    c, x, y = inputs[0], inputs[1], inputs[2]
    if x.dtype in WIDE_UNSIGNED:
        return [torch.where(c, widen(x), widen(y)).to(x.dtype)]
    return [torch.where(c, x, y)]
