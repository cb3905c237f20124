"""Normalisation ops: Batch/Instance/Layer/Group/RMS normalisation, LpNormalization, MVN, LRN."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import axes_of, axis_of, opt
from .registry import OpContext, register_op

Tensor = torch.Tensor


def _chan(t: Tensor, rank: int) -> Tensor:
    """A per-channel vector shaped to broadcast over (N, C, ...)."""
    return t.reshape(1, -1, *([1] * (rank - 2)))


@register_op("BatchNormalization")
def batch_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Inference: y = (x - mean) / sqrt(var + eps) * scale + B.  Training mode (opset 14+) uses batch stats
    and also returns the updated running stats: running = running * momentum + batch * (1 - momentum)."""
    x, scale, bias, mean, var = inputs[:5]
    eps = attrs.get("epsilon", 1e-5)
    momentum = attrs.get("momentum", 0.9)
    training = attrs.get("training_mode", 0) if ctx.opset >= 14 else int(ctx.num_outputs > 1)
    if not training:
        if x.dim() >= 2 and x.dtype in (torch.float32, torch.float64) and mean.dtype == x.dtype:
            return [F.batch_norm(x, mean, var, scale, bias, False, 0.0, eps)]
        r = x.dim()
        inv = torch.rsqrt(var.to(x.dtype) + eps)
        y = (x - _chan(mean.to(x.dtype), r)) * _chan(inv * scale.to(x.dtype), r) + _chan(bias.to(x.dtype), r)
        return [y]
    dims = [d for d in range(x.dim()) if d != 1]
    bmean = x.mean(dim=dims)
    bvar = x.var(dim=dims, unbiased=False)
    r = x.dim()
    y = (x - _chan(bmean, r)) * _chan(torch.rsqrt(bvar + eps) * scale, r) + _chan(bias, r)
    run_mean = mean * momentum + bmean * (1 - momentum)
    run_var = var * momentum + bvar * (1 - momentum)
    if ctx.opset >= 14:
        return [y, run_mean, run_var][: max(ctx.num_outputs, 1)]
    return [y, run_mean, run_var, bmean, bvar][: max(ctx.num_outputs, 1)]


@register_op("InstanceNormalization")
def instance_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, scale, bias = inputs[:3]
    return [F.instance_norm(x, weight=scale, bias=bias, eps=attrs.get("epsilon", 1e-5))]


@register_op("LayerNormalization")
def layer_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = (x - mean) / sqrt(var + eps) * scale + B over axes [axis, rank); also Mean and InvStdDev."""
    x, scale, bias = inputs[0], inputs[1], opt(inputs, 2)
    a = axis_of(attrs.get("axis", -1), x.dim())
    eps = attrs.get("epsilon", 1e-5)
    norm_shape = tuple(x.shape[a:])
    if ctx.num_outputs == 1 and tuple(scale.shape) == norm_shape and (bias is None or tuple(bias.shape) ==
                                                                       norm_shape):
        if x.dtype in (torch.float16, torch.bfloat16) and attrs.get("stash_type", 1) == 1:
            y = F.layer_norm(x.float(), norm_shape, scale.float(), None if bias is None else bias.float(), eps)
            return [y.to(x.dtype)]
        return [F.layer_norm(x, norm_shape, scale, bias, eps)]
    dims = tuple(range(a, x.dim()))
    xc = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    mean = xc.mean(dim=dims, keepdim=True)
    var = ((xc - mean) ** 2).mean(dim=dims, keepdim=True)
    inv = torch.rsqrt(var + eps)
    y = ((xc - mean) * inv).to(x.dtype) * scale
    if bias is not None:
        y = y + bias
    return [y, mean, inv][: max(ctx.num_outputs, 1)]


@register_op("RMSNormalization")
def rms_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = x / sqrt(mean(x^2 over [axis, rank)) + eps) * scale."""
    x, scale = inputs[0], inputs[1]
    a = axis_of(attrs.get("axis", -1), x.dim())
    eps = attrs.get("epsilon", 1e-5)
    dims = tuple(range(a, x.dim()))
    xc = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    y = xc * torch.rsqrt((xc * xc).mean(dim=dims, keepdim=True) + eps)
    return [y.to(x.dtype) * scale]


@register_op("GroupNormalization")
def group_norm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Opset 18: scale/bias per group; opset 21: per channel."""
    x, scale, bias = inputs[:3]
    g = attrs["num_groups"]
    eps = attrs.get("epsilon", 1e-5)
    c = x.shape[1]
    if scale.numel() == g and g != c:
        scale = scale.repeat_interleave(c // g)
        bias = bias.repeat_interleave(c // g)
    if x.dtype in (torch.float16, torch.bfloat16):
        return [F.group_norm(x.float(), g, scale.float(), bias.float(), eps).to(x.dtype)]
    return [F.group_norm(x, g, scale, bias, eps)]


@register_op("LpNormalization")
def lp_normalization(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    a = axis_of(attrs.get("axis", -1), x.dim())
    p = attrs.get("p", 2)
    if p not in (1, 2):
        raise UnsupportedOpError(ctx.unsupported(f"p={p}"))
    norm = torch.linalg.vector_norm(x, ord=p, dim=a, keepdim=True)
    return [torch.where(norm == 0, torch.zeros_like(x), x / norm)]


@register_op("MeanVarianceNormalization")
def mvn(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = (x - E[x]) / (sqrt(E[x^2] - E[x]^2) + 1e-9) over `axes` (default [0, 2, 3])."""
    x = inputs[0]
    dims = axes_of(list(attrs.get("axes", [0, 2, 3])), x.dim())
    mean = x.mean(dim=dims, keepdim=True)
    var = (x * x).mean(dim=dims, keepdim=True) - mean * mean
    return [(x - mean) / (torch.sqrt(var) + 1e-9)]


@register_op("LRN")
def lrn(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """y = x / (bias + alpha / size * sum_{c' in window(c)} x[c']^2) ** beta,
    window(c) = [c - floor((size - 1) / 2), c + ceil((size - 1) / 2)] (channels outside [0, C) add nothing)."""
    x = inputs[0]
    size = attrs["size"]
    alpha, beta, bias = attrs.get("alpha", 1e-4), attrs.get("beta", 0.75), attrs.get("bias", 1.0)
    lo, hi = (size - 1) // 2, math.ceil((size - 1) / 2)
    channels = x.shape[1]
    sq = x * x
    s = sq.clone()
    for k in range(1, min(lo, channels - 1) + 1):  # the window's sum as shifted in-place adds (no padded copy)
        s[:, k:] += sq[:, :channels - k]
    for k in range(1, min(hi, channels - 1) + 1):
        s[:, :channels - k] += sq[:, k:]
    d = s.mul_(alpha / size).add_(bias)
    if beta == 0.75:  # AlexNet / GoogLeNet's value: d^-0.75 = rsqrt(d) * sqrt(rsqrt(d)), 3x cheaper than pow
        r = d.rsqrt_()
        return [x * r * r.sqrt()]
    return [x / d.pow_(beta)]
