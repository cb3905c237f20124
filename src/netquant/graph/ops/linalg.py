"""Linear algebra: MatMul, Gemm, Einsum, Det."""

from __future__ import annotations

from typing import Any

import torch

from ._util import opt
from .registry import OpContext, register_op

Tensor = torch.Tensor


def _matmul(a: Tensor, b: Tensor) -> Tensor:
    if a.is_floating_point():
        if a.dim() > 2 and b.dim() == 2 and not a.is_contiguous():
            # torch folds [..., K] @ [K, N] into one GEMM only for a foldable view; a transposed one (a seq-first
            # encoder's [seq, batch, K]) went to batched GEMMs of seq rows: 25% slower than copy + one GEMM
            a = a.contiguous()
        return torch.matmul(a, b)
    dt = a.dtype
    # integer matmul: torch CPU lacks some int kernels; int64 is exact for the sizes ONNX tests use
    return torch.matmul(a.to(torch.int64), b.to(torch.int64)).to(dt)


@register_op("MatMul")
def matmul(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [_matmul(inputs[0], inputs[1])]


@register_op("Gemm")
def gemm(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Y = alpha * A' @ B' + beta * C."""
    a, b, c = inputs[0], inputs[1], opt(inputs, 2)
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    if attrs.get("transA", 0):
        a = a.t()
    if attrs.get("transB", 0):
        b = b.t()
    if c is not None and alpha == 1.0 and beta == 1.0 and a.is_floating_point():
        return [torch.addmm(c, a, b) if c.dim() <= 2 else torch.mm(a, b) + c]
    y = _matmul(a, b)
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c * beta if beta != 1.0 else c)
    return [y]


@register_op("Einsum")
def einsum(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    eq = attrs["equation"].replace(" ", "")
    xs = [x for x in inputs if x is not None]
    dt = xs[0].dtype
    if not xs[0].is_floating_point():
        return [torch.einsum(eq, *[x.to(torch.int64) for x in xs]).to(dt)]
    return [torch.einsum(eq, *xs)]


@register_op("Det")
def det(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return [torch.linalg.det(inputs[0])]
