"""Training losses: NegativeLogLikelihoodLoss, SoftmaxCrossEntropyLoss."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from netquant.errors import UnsupportedOpError

from ._util import opt
from .registry import OpContext, register_op

Tensor = torch.Tensor


def _nll(logp: Tensor, target: Tensor, weight: Tensor | None, reduction: str, ignore: int | None,
         ctx: OpContext) -> Tensor:
    if reduction not in ("none", "sum", "mean"):
        raise UnsupportedOpError(ctx.unsupported(f"reduction '{reduction}'"))
    t = target.to(torch.int64)
    ignore_index = -100 if ignore is None else ignore
    if ignore is None and bool((t == -100).any()):
        ignore_index = -(2**62)
    return F.nll_loss(logp, t, weight, ignore_index=ignore_index, reduction=reduction)


@register_op("NegativeLogLikelihoodLoss")
def nll_loss(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, target, w = inputs[0], inputs[1], opt(inputs, 2)
    return [_nll(x, target, w, attrs.get("reduction", "mean"), attrs.get("ignore_index"), ctx)]


@register_op("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x, target, w = inputs[0], inputs[1], opt(inputs, 2)
    logp = torch.log_softmax(x, dim=1)
    loss = _nll(logp, target, w, attrs.get("reduction", "mean"), attrs.get("ignore_index"), ctx)
    return [loss, logp][: max(ctx.num_outputs, 1)]
