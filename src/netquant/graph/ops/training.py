"""Training optimisers of the ai.onnx.preview.training domain: Adagrad, Momentum, Adam."""

from __future__ import annotations

import math
from typing import Any

import torch

from .registry import OpContext, register_op

Tensor = torch.Tensor
TRAINING = "ai.onnx.preview.training"


@register_op("Adagrad", domain=TRAINING)
def adagrad(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    r, t = inputs[0], inputs[1]
    n = (len(inputs) - 2) // 3
    xs, gs, hs = inputs[2:2 + n], inputs[2 + n:2 + 2 * n], inputs[2 + 2 * n:]
    decay, eps, norm = attrs.get("decay_factor", 0.0), attrs.get("epsilon", 0.0), attrs.get("norm_coefficient", 0.0)
    lr = r / (1 + t * decay)
    new_x, new_h = [], []
    for x, g, h in zip(xs, gs, hs):
        g = norm * x + g
        h2 = h + g * g
        new_x.append((x - lr * g / (torch.sqrt(h2) + eps)).to(x.dtype))
        new_h.append(h2.to(h.dtype))
    return new_x + new_h


@register_op("Momentum", domain=TRAINING)
def momentum(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    r, t = inputs[0], inputs[1]
    n = (len(inputs) - 2) // 3
    xs, gs, vs = inputs[2:2 + n], inputs[2 + n:2 + 2 * n], inputs[2 + 2 * n:]
    alpha, beta, norm = attrs["alpha"], attrs["beta"], attrs.get("norm_coefficient", 0.0)
    mode = attrs.get("mode", "standard")
    beta_adj = beta if int(t) > 0 else 1.0
    new_x, new_v = [], []
    for x, g, v in zip(xs, gs, vs):
        g = norm * x + g
        v2 = alpha * v + beta_adj * g
        step = v2 if mode == "standard" else g + alpha * v2
        new_x.append((x - r * step).to(x.dtype))
        new_v.append(v2.to(v.dtype))
    return new_x + new_v


@register_op("Adam", domain=TRAINING)
def adam(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    r, t = inputs[0], inputs[1]
    n = (len(inputs) - 2) // 4
    xs, gs = inputs[2:2 + n], inputs[2 + n:2 + 2 * n]
    vs, hs = inputs[2 + 2 * n:2 + 3 * n], inputs[2 + 3 * n:]
    alpha, beta = attrs.get("alpha", 0.9), attrs.get("beta", 0.999)
    eps, norm, post = attrs.get("epsilon", 1e-6), attrs.get("norm_coefficient", 0.0), \
        attrs.get("norm_coefficient_post", 0.0)
    tt = float(t)
    lr = r * math.sqrt(1 - beta**tt) / (1 - alpha**tt) if tt > 0 else r
    new_x, new_v, new_h = [], [], []
    for x, g, v, h in zip(xs, gs, vs, hs):
        g = norm * x + g
        v2 = alpha * v + (1 - alpha) * g
        h2 = beta * h + (1 - beta) * g * g
        x2 = (x - lr * (v2 / (torch.sqrt(h2) + eps))) * (1 - post)
        new_x.append(x2.to(x.dtype))
        new_v.append(v2.to(v.dtype))
        new_h.append(h2.to(h.dtype))
    return new_x + new_v + new_h
