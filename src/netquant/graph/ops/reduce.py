"""Reductions and scans along axes (ReduceX, ArgMax/ArgMin, TopK, CumSum/CumProd).  Axes are an attribute before opset 13 (ReduceSum) / 18 (others)
and an optional input after; `noop_with_empty_axes` decides what empty axes mean."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ._util import axes_of, axis_of, ints, opt, widen
from .registry import OpContext, register_op

Tensor = torch.Tensor


def _sum(x: Tensor, dims: list[int], keep: bool) -> Tensor:
    return torch.sum(x, dim=dims, keepdim=keep)


def _mean(x: Tensor, dims: list[int], keep: bool) -> Tensor:
    return torch.mean(x, dim=dims, keepdim=keep)


def _amax(x: Tensor, dims: list[int], keep: bool) -> Tensor:
    return torch.amax(x, dim=dims, keepdim=keep)


def _amin(x: Tensor, dims: list[int], keep: bool) -> Tensor:
    return torch.amin(x, dim=dims, keepdim=keep)


def _prod(x: Tensor, dims: list[int], keep: bool) -> Tensor:
    for d in sorted(dims, reverse=True):
        x = torch.prod(x, dim=d, keepdim=keep) if keep else torch.prod(x, dim=d)
    return x


def _l1(x: Tensor, dims: list[int], keep: bool) -> Tensor:
    return torch.sum(torch.abs(x), dim=dims, keepdim=keep)


def _l2(x: Tensor, dims: list[int], keep: bool) -> Tensor:
    if x.is_floating_point():
        return torch.sqrt(torch.sum(x * x, dim=dims, keepdim=keep))
    return torch.sqrt(torch.sum(x * x, dim=dims, keepdim=keep).double()).to(x.dtype)


def _log_sum(x: Tensor, dims: list[int], keep: bool) -> Tensor:
    return torch.log(torch.sum(x, dim=dims, keepdim=keep))


def _log_sum_exp(x: Tensor, dims: list[int], keep: bool) -> Tensor:
    if x.is_floating_point():
        return torch.logsumexp(x, dim=dims, keepdim=keep)
    return torch.logsumexp(x.double(), dim=dims, keepdim=keep).to(x.dtype)


def _sum_square(x: Tensor, dims: list[int], keep: bool) -> Tensor:
    return torch.sum(x * x, dim=dims, keepdim=keep)


# value of each reduction over an empty set
_EMPTY: dict[str, float] = {"ReduceSum": 0, "ReduceL1": 0, "ReduceL2": 0, "ReduceSumSquare": 0, "ReduceProd": 1,
                            "ReduceLogSum": -math.inf, "ReduceLogSumExp": -math.inf, "ReduceMax": -math.inf,
                            "ReduceMin": math.inf, "ReduceMean": math.nan}


def _reduce(op_type: str, fn: Callable[[Tensor, list[int], bool], Tensor], axes_input_since: int) -> None:
    def compute(x: Tensor, axes: list[int] | None, attrs: dict[str, Any]) -> Tensor:
        keep = bool(attrs.get("keepdims", 1))
        if axes is None or len(axes) == 0:
            if attrs.get("noop_with_empty_axes", 0):
                return x
            dims = list(range(x.dim()))
        else:
            dims = sorted(set(axes_of(axes, x.dim())))
        if x.dim() == 0:
            return fn(x.reshape(1), [0], False)
        if not dims:
            return x
        if any(x.shape[d] == 0 for d in dims):
            shp = [1 if d in dims else s for d, s in enumerate(x.shape)] if keep else \
                [s for d, s in enumerate(x.shape) if d not in dims]
            fill = _EMPTY[op_type]
            if x.dtype == torch.bool:
                fill = fill > 0 if math.isinf(fill) else bool(fill)
            elif not x.is_floating_point() and math.isinf(fill):
                info = torch.iinfo(x.dtype)
                fill = info.min if fill < 0 else info.max
            return torch.full(shp, fill, dtype=x.dtype, device=x.device)
        dt = x.dtype
        out = fn(widen(x), dims, keep)
        return out.to(dt) if out.dtype != dt else out

    @register_op(op_type)
    def legacy(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        axes = attrs.get("axes")
        return [compute(inputs[0], ints(axes) if axes is not None else None, attrs)]

    @register_op(op_type, since=axes_input_since)
    def modern(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        axes = opt(inputs, 1)
        return [compute(inputs[0], ints(axes) if axes is not None else None, attrs)]

    legacy.__name__ = f"{op_type.lower()}_v1"
    modern.__name__ = op_type.lower()


_reduce("ReduceSum", _sum, 13)
_reduce("ReduceMean", _mean, 18)
_reduce("ReduceMax", _amax, 18)
_reduce("ReduceMin", _amin, 18)
_reduce("ReduceProd", _prod, 18)
_reduce("ReduceL1", _l1, 18)
_reduce("ReduceL2", _l2, 18)
_reduce("ReduceLogSum", _log_sum, 18)
_reduce("ReduceLogSumExp", _log_sum_exp, 18)
_reduce("ReduceSumSquare", _sum_square, 18)


def _arg(op_type: str, largest: bool) -> None:
    @register_op(op_type)
    def impl(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        x = inputs[0]
        a = axis_of(attrs.get("axis", 0), x.dim())
        keep = bool(attrs.get("keepdims", 1))
        xx = widen(x)
        if attrs.get("select_last_index", 0):
            xf = xx.flip(a)
            idx = torch.argmax(xf, a, keepdim=keep) if largest else torch.argmin(xf, a, keepdim=keep)
            idx = x.shape[a] - 1 - idx
        else:
            idx = torch.argmax(xx, a, keepdim=keep) if largest else torch.argmin(xx, a, keepdim=keep)
        return [idx]

    impl.__name__ = op_type.lower()


_arg("ArgMax", True)
_arg("ArgMin", False)


def _cum(op_type: str, fn) -> None:
    @register_op(op_type)
    def impl(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
        x, axis = inputs[0], inputs[1]
        a = axis_of(int(axis.reshape(-1)[0]), x.dim())
        dt = x.dtype
        y = widen(x)
        rev = attrs.get("reverse", 0)
        if rev:
            y = y.flip(a)
        out = fn(y, a)
        if attrs.get("exclusive", 0):
            ident = torch.zeros_like if op_type == "CumSum" else torch.ones_like
            first = ident(out.narrow(a, 0, 1))
            out = torch.cat([first, out.narrow(a, 0, out.shape[a] - 1)], dim=a)
        if rev:
            out = out.flip(a)
        return [out.to(dt)]

    impl.__name__ = op_type.lower()


_cum("CumSum", lambda x, a: torch.cumsum(x, a))
_cum("CumProd", lambda x, a: torch.cumprod(x, a))


@register_op("TopK")
def topk_v1(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return _topk(inputs[0], attrs["k"], attrs.get("axis", -1), True, True)


@register_op("TopK", since=10)
def topk(inputs: list[Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[Tensor]:
    return _topk(inputs[0], int(inputs[1].reshape(-1)[0]), attrs.get("axis", -1),
                 bool(attrs.get("largest", 1)), bool(attrs.get("sorted", 1)))


def _topk(x: Tensor, k: int, axis: int, largest: bool, sort: bool) -> list[Tensor]:
    """Ties resolve to the lower index (ONNX); torch.topk does not promise that, so use a stable sort."""
    a = axis_of(axis, x.dim())
    xs = widen(x)
    order = torch.sort(xs, dim=a, descending=largest, stable=True)
    vals = order.values.narrow(a, 0, k).to(x.dtype)
    idx = order.indices.narrow(a, 0, k)
    return [vals, idx]
