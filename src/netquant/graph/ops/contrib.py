"""onnxruntime com.microsoft fused ops that optimised transformer exports contain (float math only)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ._util import axis_of, opt
from .registry import OpContext, register_op

Tensor = torch.Tensor
MS = "com.microsoft"


@register_op("Gelu", domain=MS)
def ms_gelu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = x * Phi(x) (erf form)."""
    return [F.gelu(inputs[0])]


@register_op("BiasGelu", domain=MS)
def bias_gelu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [F.gelu(inputs[0] + inputs[1])]


@register_op("FastGelu", domain=MS)
def fast_gelu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """tanh approximation of gelu on x (+ optional bias)."""
    x = inputs[0] if opt(inputs, 1) is None else inputs[0] + inputs[1]
    return [F.gelu(x, approximate="tanh")]


@register_op("QuickGelu", domain=MS)
def quick_gelu(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = x * sigmoid(alpha * x), alpha default 1.702."""
    x = inputs[0]
    return [x * torch.sigmoid(attrs.get("alpha", 1.702) * x)]


@register_op("FusedMatMul", domain=MS)
def fused_matmul(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = alpha * op(A) @ op(B), op = transpose of the last two dims when transA / transB."""
    a, b = inputs[0], inputs[1]
    if attrs.get("transBatchA", 0) or attrs.get("transBatchB", 0):
        from netquant.errors import UnsupportedOpError

        raise UnsupportedOpError(ctx.unsupported("transBatchA / transBatchB"))
    if attrs.get("transA", 0):
        a = a.transpose(-1, -2)
    if attrs.get("transB", 0):
        b = b.transpose(-1, -2)
    y = torch.matmul(a, b)
    alpha = attrs.get("alpha", 1.0)
    return [y * alpha if alpha != 1.0 else y]


def _skip_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext, rms: bool) -> list[Tensor]:
    """s = input + skip (+ bias); y = norm(s) * gamma (+ beta); outputs y, mean, inv_std_var, s."""
    x, skip, gamma = inputs[0], inputs[1], inputs[2]
    beta = None if rms else opt(inputs, 3)
    bias = opt(inputs, 3 if rms else 4)
    eps = attrs.get("epsilon", 1e-12)
    s = x + skip
    if bias is not None:
        s = s + bias
    sf = s.float() if s.dtype in (torch.float16, torch.bfloat16) else s
    if rms:
        mean = torch.zeros_like(sf[..., :1])
        inv = torch.rsqrt((sf * sf).mean(-1, keepdim=True) + eps)
        y = sf * inv
    else:
        mean = sf.mean(-1, keepdim=True)
        inv = torch.rsqrt(((sf - mean) ** 2).mean(-1, keepdim=True) + eps)
        y = (sf - mean) * inv
    y = y.to(x.dtype) * gamma
    if beta is not None:
        y = y + beta
    return [y, mean, inv, s][: max(ctx.num_outputs, 1)]


@register_op("SkipLayerNormalization", domain=MS)
def skip_layer_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return _skip_norm(inputs, attrs, ctx, rms=False)


@register_op("SkipSimplifiedLayerNormalization", domain=MS)
def skip_simplified_layer_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return _skip_norm(inputs, attrs, ctx, rms=True)


@register_op("SimplifiedLayerNormalization")
def simplified_layer_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """RMS norm over [axis, rank) (onnxruntime registers it in the ai.onnx domain): y = x / rms * scale."""
    x, scale = inputs[0], inputs[1]
    a = axis_of(attrs.get("axis", -1), x.dim())
    dims = tuple(range(a, x.dim()))
    xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    inv = torch.rsqrt((xf * xf).mean(dim=dims, keepdim=True) + attrs.get("epsilon", 1e-5))
    return [(xf * inv).to(x.dtype) * scale, inv][: max(ctx.num_outputs, 1)]


@register_op("BiasAdd", domain=MS)
def bias_add(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [inputs[0] + inputs[1] + inputs[2]]


@register_op("BiasSoftmax", domain=MS)
def bias_softmax(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [torch.softmax(inputs[0] + inputs[1], dim=attrs.get("axis", 1))]


__all__ = ["math"]
