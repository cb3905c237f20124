"""Activation ops and the softmax family."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import axis_of, opt
from .registry import OpContext, register_op

Tensor = torch.Tensor


@register_op("Relu")
def relu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    return [torch.relu(x) if x.is_floating_point() else torch.clamp(x, min=0)]


@register_op("LeakyRelu")
def leaky_relu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [F.leaky_relu(inputs[0], attrs.get("alpha", 0.01))]


@register_op("PRelu")
def prelu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = x if x >= 0 else slope * x (slope broadcasts to x)."""
    x, slope = inputs[0], inputs[1]
    return [torch.where(x >= 0, x, x * slope)]


@register_op("Elu")
def elu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [F.elu(inputs[0], attrs.get("alpha", 1.0))]


@register_op("Celu")
def celu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [F.celu(inputs[0], attrs.get("alpha", 1.0))]


@register_op("Selu")
def selu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    alpha = attrs.get("alpha", 1.67326319217681884765625)
    gamma = attrs.get("gamma", 1.05070102214813232421875)
    return [gamma * torch.where(x > 0, x, alpha * (torch.exp(x) - 1))]


@register_op("Sigmoid")
def sigmoid(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [torch.sigmoid(inputs[0])]


@register_op("HardSigmoid")
def hard_sigmoid(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = clamp(alpha * x + beta, 0, 1)."""
    alpha, beta = attrs.get("alpha", 0.2), attrs.get("beta", 0.5)
    return [torch.mul(inputs[0], alpha).add_(beta).clamp_(0.0, 1.0)]  # one buffer, same values


@register_op("HardSwish")
def hard_swish(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [F.hardswish(inputs[0])]


@register_op("Tanh")
def tanh(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [torch.tanh(inputs[0])]


@register_op("Softplus")
def softplus(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [F.softplus(inputs[0])]


@register_op("Softsign")
def softsign(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [F.softsign(inputs[0])]


@register_op("Mish")
def mish(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [F.mish(inputs[0])]


@register_op("Swish")
def swish(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = x * sigmoid(alpha * x)."""
    x = inputs[0]
    alpha = attrs.get("alpha", 1.0)
    return [x * torch.sigmoid(x * alpha) if alpha != 1.0 else F.silu(x)]


@register_op("Gelu")
def gelu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    approx = attrs.get("approximate", "none")
    if approx not in ("none", "tanh"):
        raise UnsupportedOpError(ctx.unsupported(f"approximate='{approx}'"))
    return [F.gelu(inputs[0], approximate=approx)]


@register_op("ThresholdedRelu")
def thresholded_relu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    return [torch.where(x > attrs.get("alpha", 1.0), x, torch.zeros_like(x))]


@register_op("Shrink")
def shrink(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    lambd, bias = attrs.get("lambd", 0.5), attrs.get("bias", 0.0)
    xf = x if x.is_floating_point() else x.to(torch.float64)
    out = torch.where(xf < -lambd, xf + bias, torch.where(xf > lambd, xf - bias, torch.zeros_like(xf)))
    return [out.to(x.dtype)]


@register_op("Clip")
def clip_v1(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    lo, hi = attrs.get("min", -math.inf), attrs.get("max", math.inf)
    return [torch.clamp(inputs[0], lo, hi)]


@register_op("Clip", since=11)
def clip(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, lo, hi = inputs[0], opt(inputs, 1), opt(inputs, 2)
    if lo is None and hi is None:
        return [x]
    if x.is_floating_point() and x.is_cuda:
        return [torch.clamp(x, lo, hi)]
    # python-number bounds: torch's CPU clamp with tensor bounds is ~10x slower than with scalars
    lo_v = None if lo is None else lo.reshape(()).item()
    hi_v = None if hi is None else hi.reshape(()).item()
    return [torch.clamp(x, lo_v, hi_v)]


def _coerced_2d(x: Tensor, axis: int) -> tuple[Tensor, torch.Size]:
    shape = x.shape
    a = axis_of(axis, x.dim())
    lead = math.prod(shape[:a])
    return x.reshape(lead, -1), shape


def _softmax_family(op_type: str, fn) -> None:
    @register_op(op_type)
    def legacy(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        """Opset < 13: input coerced to 2-D at `axis` (default 1), normalised over the trailing part."""
        x = inputs[0]
        if x.dim() == 0:
            return [fn(x.reshape(1, 1), 1).reshape(())]
        x2, shape = _coerced_2d(x, attrs.get("axis", 1))
        return [fn(x2, 1).reshape(shape)]

    @register_op(op_type, since=13)
    def modern(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        x = inputs[0]
        return [fn(x, attrs.get("axis", -1))]

    legacy.__name__ = f"{op_type.lower()}_v1"
    modern.__name__ = op_type.lower()


def _hardmax(x: Tensor, dim: int) -> Tensor:
    idx = torch.argmax(x, dim=dim, keepdim=True)
    return torch.zeros_like(x).scatter_(dim, idx, 1)


def _softmax(x: Tensor, dim: int) -> Tensor:
    """exp(x - max) / sum(exp(x - max)).  Half types follow the spec's op-by-op body (each step rounded to
    the input type, as the ONNX reference and onnxruntime compute it); wider types use torch's fused kernel."""
    if x.dtype in (torch.float16, torch.bfloat16):
        e = torch.exp(x - x.amax(dim, keepdim=True))
        return e / e.sum(dim, keepdim=True)
    return torch.softmax(x, dim)


_softmax_family("Softmax", _softmax)
_softmax_family("LogSoftmax", lambda x, d: torch.log_softmax(x, d))
_softmax_family("Hardmax", _hardmax)
