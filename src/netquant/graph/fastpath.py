"""In-place variants of cheap elementwise ops, used by the Executor when nothing can observe the overwrite.

The executor calls these only when (a) no hooks are attached and no gradient is recorded, (b) the
overwritten input dies at this op (its last reader), is no graph input / initializer / kept value, and
(c) no other tensor shares its storage (views, aliases).  Each function returns the result tensor, or
None when its own preconditions fail (dtype promotion, broadcasting that would grow the input, ...);
the executor then runs the regular implementation.  Results equal the out-of-place ops bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

Tensor = torch.Tensor
# fn(inputs, attrs, opset, target index) -> result or None
InplaceFn = Callable[[list[Any], dict[str, Any], int, int], Tensor | None]


def storage_is_private(t: Tensor) -> bool:
    """True when no other live tensor shares t's storage (the temporary storage object counts once)."""
    if t._is_view() or t.requires_grad:
        return False
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata) == 2


def _fits(target: Tensor, other: Any) -> bool:
    """other broadcasts into target without changing target's shape or dtype."""
    if not isinstance(other, Tensor):
        return False
    if other.device != target.device or torch.result_type(target, other) != target.dtype:
        return False
    if other.dim() > target.dim():
        return False
    return all(b in (a, 1) for a, b in zip(reversed(target.shape), reversed(other.shape)))


def _binary(method: str, commutative: bool) -> InplaceFn:
    def run(inputs: list[Any], attrs: dict[str, Any], opset: int, idx: int) -> Tensor | None:
        if len(inputs) != 2 or (idx == 1 and not commutative):
            return None
        target, other = inputs[idx], inputs[1 - idx]
        if not target.is_floating_point() or not _fits(target, other):
            return None
        return getattr(target, method)(other)

    return run


def _sum(inputs: list[Any], attrs: dict[str, Any], opset: int, idx: int) -> Tensor | None:
    target = inputs[idx]
    if idx != 0 and len(inputs) > 2:  # keep the left-to-right summation order
        return None
    if not target.is_floating_point() or any(t is None for t in inputs):
        return None
    others = [t for i, t in enumerate(inputs) if i != idx]
    if not all(_fits(target, o) for o in others):
        return None
    for o in others:
        target.add_(o)
    return target


def _relu(inputs: list[Any], attrs: dict[str, Any], opset: int, idx: int) -> Tensor | None:
    x = inputs[0]
    return x.relu_() if idx == 0 and x.is_floating_point() else None


def _sigmoid(inputs: list[Any], attrs: dict[str, Any], opset: int, idx: int) -> Tensor | None:
    x = inputs[0]
    return x.sigmoid_() if idx == 0 and x.is_floating_point() else None


def _clip(inputs: list[Any], attrs: dict[str, Any], opset: int, idx: int) -> Tensor | None:
    x = inputs[0]
    if idx != 0 or not x.is_floating_point():
        return None
    if opset < 11:
        return x.clamp_(attrs.get("min", -math.inf), attrs.get("max", math.inf))
    lo = inputs[1] if len(inputs) > 1 else None
    hi = inputs[2] if len(inputs) > 2 else None
    if lo is None and hi is None:
        return None
    for bound in (lo, hi):
        if bound is not None and (bound.numel() != 1 or bound.dtype != x.dtype or bound.device != x.device):
            return None
    # python scalars take clamp's fast path (0-d tensor bounds go through broadcasting); same values
    return x.clamp_(None if lo is None else lo.item(), None if hi is None else hi.item())


def _hard_sigmoid(inputs: list[Any], attrs: dict[str, Any], opset: int, idx: int) -> Tensor | None:
    x = inputs[0]
    if idx != 0 or not x.is_floating_point():
        return None
    return x.mul_(attrs.get("alpha", 0.2)).add_(attrs.get("beta", 0.5)).clamp_(0.0, 1.0)


INPLACE: dict[str, InplaceFn] = {
    "Add": _binary("add_", True),
    "Mul": _binary("mul_", True),
    "Sub": _binary("sub_", False),
    "Div": _binary("div_", False),
    "Sum": _sum,
    "Relu": _relu,
    "Sigmoid": _sigmoid,
    "Clip": _clip,
    "HardSigmoid": _hard_sigmoid,
}
