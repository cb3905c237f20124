"""Sequences and optionals (python lists / None): Sequence*, SplitToSequence, ConcatFromSequence,
Optional*, SequenceMap."""

from __future__ import annotations

from typing import Any

import torch

from netquant.errors import UnsupportedOpError

from ._util import axis_of, ints, opt, subgraph_runner
from .registry import OpContext, register_op

Tensor = torch.Tensor


@register_op("SequenceEmpty")
def sequence_empty(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    return [[]]


@register_op("SequenceConstruct")
def sequence_construct(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    return [list(inputs)]


@register_op("SequenceLength")
def sequence_length(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    return [torch.tensor(len(inputs[0]), dtype=torch.int64)]


def _pos(p: Tensor | None, n: int, default: int) -> int:
    if p is None:
        return default
    i = int(p.reshape(-1)[0])
    return i + n if i < 0 else i


@register_op("SequenceAt")
def sequence_at(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    seq = inputs[0]
    return [seq[_pos(inputs[1], len(seq), 0)]]


@register_op("SequenceInsert")
def sequence_insert(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    seq = list(inputs[0])
    seq.insert(_pos(opt(inputs, 2), len(seq), len(seq)), inputs[1])
    return [seq]


@register_op("SequenceErase")
def sequence_erase(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    seq = list(inputs[0])
    del seq[_pos(opt(inputs, 1), len(seq), len(seq) - 1)]
    return [seq]


@register_op("ConcatFromSequence")
def concat_from_sequence(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    seq = inputs[0]
    a = attrs["axis"]
    if attrs.get("new_axis", 0):
        return [torch.stack(seq, dim=axis_of(a, seq[0].dim() + 1))]
    return [torch.cat(seq, dim=a)]


@register_op("SplitToSequence")
def split_to_sequence(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    x, split = inputs[0], opt(inputs, 1)
    a = axis_of(attrs.get("axis", 0), x.dim())
    if split is None:
        parts = list(torch.split(x, 1, dim=a))
        if not attrs.get("keepdims", 1):
            parts = [p.squeeze(a) for p in parts]
        return [parts]
    if split.dim() == 0:
        return [list(torch.split(x, int(split), dim=a))]
    return [list(torch.split(x, ints(split), dim=a))]


@register_op("Optional")
def optional(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    return [opt(inputs, 0)]


@register_op("OptionalHasElement")
def optional_has_element(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    return [torch.tensor(opt(inputs, 0) is not None)]


@register_op("OptionalGetElement")
def optional_get_element(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    if inputs[0] is None:
        raise UnsupportedOpError(ctx.unsupported("reading an empty optional"))
    return [inputs[0]]


@register_op("SequenceMap")
def sequence_map(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    """Run `body` once per element of the input sequence; extra inputs are indexed when sequences."""
    seq, extra = inputs[0], list(inputs[1:])
    run = subgraph_runner(ctx)
    outs: list[list[Any]] | None = None
    for i, item in enumerate(seq):
        args = [item] + [a[i] if isinstance(a, list) else a for a in extra]
        res = run(attrs["body"], args)
        if outs is None:
            outs = [[] for _ in res]
        for acc, r in zip(outs, res):
            acc.append(r)
    return outs if outs is not None else [[] for _ in range(ctx.num_outputs)]
