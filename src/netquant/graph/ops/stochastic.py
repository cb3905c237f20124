"""Random ops: Dropout, Bernoulli, RandomNormal/Uniform(Like), Multinomial."""

from __future__ import annotations

from typing import Any

import torch

from netquant.errors import UnsupportedOpError

from ._util import ints, onnx_dtype, opt, scalar
from .registry import OpContext, register_op

Tensor = torch.Tensor


@register_op("Dropout")
def dropout(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    """Inference: identity with an all-true mask.  Training mode: y = x * mask / (1 - ratio)."""
    x = inputs[0]
    if ctx.opset >= 12:
        ratio = scalar(opt(inputs, 1), 0.5)
        training = bool(scalar(opt(inputs, 2), False))
    else:
        ratio = attrs.get("ratio", 0.5)
        training = False
    if not training or ratio == 0:
        mask = torch.ones_like(x, dtype=torch.bool)
        return [x, mask if ctx.opset >= 12 else mask.to(x.dtype)]
    gen = torch.Generator(device=x.device)
    if "seed" in attrs:
        gen.manual_seed(int(attrs["seed"]))
    else:
        gen.seed()
    mask = torch.rand(x.shape, generator=gen, device=x.device) >= ratio
    return [x * mask / (1.0 - ratio), mask]


@register_op("Bernoulli")
def bernoulli(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    dt = onnx_dtype(attrs["dtype"], ctx) if "dtype" in attrs else x.dtype
    gen = None
    if "seed" in attrs:
        gen = torch.Generator(device=x.device).manual_seed(int(attrs["seed"]))
    return [torch.bernoulli(x.double(), generator=gen).to(dt)]


def _random(op_type: str, like: bool, normal: bool) -> None:
    @register_op(op_type)
    def impl(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        if like:
            x = inputs[0]
            shape, device = list(x.shape), x.device
            dt = onnx_dtype(attrs["dtype"], ctx) if "dtype" in attrs else x.dtype
        else:
            shape, device = ints(attrs["shape"]), torch.device("cpu")
            dt = onnx_dtype(attrs.get("dtype", 1), ctx)
        gen = torch.Generator(device=device)
        if "seed" in attrs:
            gen.manual_seed(int(attrs["seed"]))
        else:
            gen.seed()
        if normal:
            out = torch.randn(shape, generator=gen, device=device, dtype=torch.float64)
            out = out * attrs.get("scale", 1.0) + attrs.get("mean", 0.0)
        else:
            lo, hi = attrs.get("low", 0.0), attrs.get("high", 1.0)
            out = torch.rand(shape, generator=gen, device=device, dtype=torch.float64) * (hi - lo) + lo
        return [out.to(dt)]

    impl.__name__ = op_type.lower()


_random("RandomUniform", False, False)
_random("RandomNormal", False, True)
_random("RandomUniformLike", True, False)
_random("RandomNormalLike", True, True)


@register_op("Multinomial")
def multinomial(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    x = inputs[0]
    gen = torch.Generator(device=x.device)
    if "seed" in attrs:
        gen.manual_seed(int(attrs["seed"]))
    probs = torch.softmax(x.double(), -1)
    out = torch.multinomial(probs, attrs.get("sample_size", 1), replacement=True, generator=gen)
    dt = onnx_dtype(attrs.get("dtype", 6), ctx)
    if dt not in (torch.int32, torch.int64):
        raise UnsupportedOpError(ctx.unsupported(f"dtype {dt}"))
    return [out.to(dt)]
