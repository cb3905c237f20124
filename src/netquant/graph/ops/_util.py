"""Shared helpers for the op implementations: dtype lookups, attribute/input access, axis handling.

The ONNX <-> torch dtype tables live in netquant.graph.dtypes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from netquant.errors import UnsupportedOpError
from netquant.graph.dtypes import ONNX_TO_TORCH

from .registry import OpContext

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz,
          torch.float8_e8m0fnu)
# Unsigned types with thin torch kernel coverage: computed in int64 and cast back.
WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)


def onnx_dtype(code: int, ctx: OpContext, what: str = "dtype") -> torch.dtype:
    """torch dtype for an ONNX data type code, or UnsupportedOpError."""
    try:
        return ONNX_TO_TORCH[int(code)]
    except KeyError:
        raise UnsupportedOpError(ctx.unsupported(f"{what} {code} (no torch dtype)")) from None


def elem_type_of(ctx: OpContext, kind: str, index: int) -> int | None:
    """The declared ONNX element type of a node input/output, when the executor supplies it in
    ctx.extras["input_elem_types"] / ctx.extras["output_elem_types"] (needed for sub-byte types)."""
    types = ctx.extras.get(f"{kind}_elem_types")
    if not types or index >= len(types):
        return None
    return types[index]


def ints(t: torch.Tensor | Sequence[int] | None) -> list[int]:
    """A 1-D int tensor or sequence as a python list of ints."""
    if t is None:
        return []
    if isinstance(t, torch.Tensor):
        return [int(v) for v in t.reshape(-1).tolist()]
    return [int(v) for v in t]


def floats(t: torch.Tensor | Sequence[float] | None) -> list[float]:
    if t is None:
        return []
    if isinstance(t, torch.Tensor):
        return [float(v) for v in t.reshape(-1).tolist()]
    return [float(v) for v in t]


def broadcast_shape(*shapes: Sequence[int]) -> tuple[int, ...]:
    """numpy broadcasting of `shapes` (torch.broadcast_shapes without its first-call import of sympy, ~2 s);
    ValueError naming the shapes when they do not broadcast."""
    rank = max((len(s) for s in shapes), default=0)
    out = [1] * rank
    for shape in shapes:
        for i, d in enumerate(shape, rank - len(shape)):
            d = int(d)
            if d == out[i] or d == 1:
                continue
            if out[i] != 1:
                raise ValueError(f"shapes {[tuple(s) for s in shapes]} do not broadcast")
            out[i] = d
    return tuple(out)


def opt(inputs: Sequence[Any], i: int) -> Any:
    """inputs[i] or None when absent."""
    return inputs[i] if i < len(inputs) else None


def axis_of(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def axes_of(axes: Sequence[int], rank: int) -> list[int]:
    return [a + rank if a < 0 else a for a in axes]


def is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def widen(t: torch.Tensor) -> torch.Tensor:
    """Unsigned 16/32/64-bit tensors as int64 (torch kernels for them are sparse); others unchanged."""
    return t.to(torch.int64) if t.dtype in WIDE_UNSIGNED else t


def scalar(t: torch.Tensor | None, default: Any = None) -> Any:
    """A 0-d / 1-element tensor as a python number."""
    if t is None:
        return default
    return t.reshape(-1)[0].item()


def subgraph_runner(ctx: OpContext) -> Any:
    """ctx.run_subgraph (runs a graph attribute), or UnsupportedOpError outside an Executor."""
    if ctx.run_subgraph is None:
        raise UnsupportedOpError(ctx.unsupported("running a subgraph outside an Executor"))
    return ctx.run_subgraph
