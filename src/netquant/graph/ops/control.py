"""Control flow: If, Loop, Scan, running their bodies through ctx.run_subgraph."""

from __future__ import annotations

from typing import Any

import torch

from netquant.errors import ModelError, UnsupportedOpError
from netquant.graph.ops.registry import OpContext, register_op


def _runner(ctx: OpContext):  # noqa: ANN202
    if ctx.run_subgraph is None:
        raise ModelError(f"{ctx.op_type} node '{ctx.name}': no subgraph runner (run it through Executor)")
    return ctx.run_subgraph


def _scalar_bool(t: Any) -> bool:
    return bool(t.reshape(-1)[0].item()) if isinstance(t, torch.Tensor) else bool(t)


@register_op("If", since=1)
def if_(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    """outputs = then_branch() if cond else else_branch()"""
    branch = attrs["then_branch"] if _scalar_bool(inputs[0]) else attrs["else_branch"]
    return list(_runner(ctx)(branch, []))


def _stack(values: list[Any], axis: int = 0) -> Any:
    if not values:
        return torch.empty(0)
    if isinstance(values[0], torch.Tensor):
        return torch.stack(values, dim=axis)
    return values


@register_op("Loop", since=1)
def loop(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    """for i in range(M) while cond: (cond, v..., scan...) = body(i, cond, v...); scan outputs stacked."""
    body = attrs["body"]
    run = _runner(ctx)
    max_trip = inputs[0] if len(inputs) > 0 else None
    cond = inputs[1] if len(inputs) > 1 else None
    carried = list(inputs[2:])
    n_carried = len(carried)
    n_scan = len(body.outputs) - 1 - n_carried
    trips = int(max_trip.reshape(-1)[0].item()) if isinstance(max_trip, torch.Tensor) else None
    keep_going = True if cond is None else _scalar_bool(cond)
    scans: list[list[Any]] = [[] for _ in range(n_scan)]
    device = next((t.device for t in carried if isinstance(t, torch.Tensor)), None)
    i = 0
    while keep_going and (trips is None or i < trips):
        it = torch.tensor(i, dtype=torch.int64, device=device)
        cond_in = torch.tensor(keep_going, dtype=torch.bool, device=device)
        outs = run(body, [it, cond_in, *carried])
        keep_going = _scalar_bool(outs[0]) if outs[0] is not None else True
        carried = list(outs[1:1 + n_carried])
        for k in range(n_scan):
            scans[k].append(outs[1 + n_carried + k])
        i += 1
    return [*carried, *(_stack(s) for s in scans)]


def _norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


@register_op("Scan", since=9)
def scan(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    """Iterate `body` over slices of the scan inputs along their scan axes, carrying N states."""
    body = attrs["body"]
    m = int(attrs["num_scan_inputs"])
    n = len(inputs) - m
    states, xs = list(inputs[:n]), list(inputs[n:])
    in_axes = [_norm_axis(a, x.dim()) for a, x in zip(attrs.get("scan_input_axes", [0] * m), xs)]
    in_dirs = attrs.get("scan_input_directions", [0] * m)
    k = len(body.outputs) - n
    out_axes = attrs.get("scan_output_axes", [0] * k)
    out_dirs = attrs.get("scan_output_directions", [0] * k)
    steps = xs[0].shape[in_axes[0]] if xs else 0
    run = _runner(ctx)
    collected: list[list[Any]] = [[] for _ in range(k)]
    for t in range(steps):
        slices = [x.select(ax, steps - 1 - t if d else t) for x, ax, d in zip(xs, in_axes, in_dirs)]
        outs = run(body, [*states, *slices])
        states = list(outs[:n])
        for j in range(k):
            collected[j].append(outs[n + j])
    results = []
    for j in range(k):
        vals = collected[j][::-1] if out_dirs[j] else collected[j]
        rank = vals[0].dim() + 1 if vals else 1
        results.append(_stack(vals, _norm_axis(out_axes[j], rank)))
    return [*states, *results]


@register_op("Scan", since=8)
def scan_v8(inputs: list[Any], attrs: dict[str, Any], ctx: OpContext) -> list[Any]:
    """Opset 8 Scan: input 0 = sequence_lens (optional), axis 0 of every tensor is the batch."""
    if ctx.opset >= 9:
        return scan(inputs, attrs, ctx)
    seq_lens = inputs[0]
    body = attrs["body"]
    m = int(attrs["num_scan_inputs"])
    rest = list(inputs[1:])
    n = len(rest) - m
    if seq_lens is not None:
        full = rest[n].shape[1]
        if bool((seq_lens != full).any()):
            raise UnsupportedOpError(ctx.unsupported("Scan-8 with sequence_lens shorter than the sequence"))
    attrs9 = {"body": body, "num_scan_inputs": m,
              "scan_input_directions": attrs.get("directions", [0] * m)}
    per_batch = [scan([t[b] for t in rest], attrs9, ctx) for b in range(rest[0].shape[0])]
    return [torch.stack([pb[j] for pb in per_batch]) for j in range(len(per_batch[0]))]
