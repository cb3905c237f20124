"""Quantizable regions of a quantized graph, and keeping chosen regions in float.

A region is one op with a weight (Conv, MatMul, Gemm: the anchor) plus the quantized ops that ride on it: its
fused tails (Conv -> Relu) and the quantized ops fed only through it (Reshape, MaxPool, Concat, AveragePool ...).
A quantized op without a weight whose producer is in no region anchors a region of its own.

Keeping a region in float edits the calibrated configs in place (no re-calibration): every config of the region's
ops becomes FP32, and each config outside the region that shared a now-float config's quantizer (OVERLAPPED: a
quantized consumer's input, a pass-through output) quantizes the tensor at its own place with the same params
(ACTIVATED, still dominated_by the same config: same scale, same zero point). `FloatEdit.undo` restores everything.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from netquant.core.tensor_config import QuantState, TensorQuantConfig
from netquant.errors import ConfigError
from netquant.graph.op_config import TensorRole
from netquant.passes.quant_graph import QuantizedGraph


@dataclass(frozen=True)
class Region:
    """One quantizable region: `anchor` (its name) and every op in it, in graph order."""

    anchor: str
    op_type: str
    ops: tuple[str, ...]


def find_regions(qgraph: QuantizedGraph) -> list[Region]:
    """The regions of `qgraph` (as quantized: ops with at least one quantized config), in graph order."""
    graph = qgraph.graph
    producer = {o: n for n in graph.nodes for o in n.outputs if o}
    region_of: dict[str, str] = {}
    members: dict[str, list[str]] = {}
    types: dict[str, str] = {}
    quantized = set(qgraph.quantized_ops())
    for node in graph.nodes:
        if node.name not in quantized:
            continue
        oc = qgraph.op_configs[node.name]
        head = qgraph.fusions.get(node.name)
        anchor: str | None = None
        if head is not None and head in region_of:
            anchor = region_of[head]
        elif oc.input_index(TensorRole.WEIGHT) is None:
            acts = [node.inputs[i] for i, r in sorted(oc.roles.items()) if r is TensorRole.ACTIVATION]
            for t in acts:
                p = producer.get(t)
                if p is not None and p.name in region_of:
                    anchor = region_of[p.name]
                    break
        if anchor is None:
            anchor = node.name
            members[anchor] = []
            types[anchor] = node.op_type
        region_of[node.name] = anchor
        members[anchor].append(node.name)
    return [Region(a, types[a], tuple(ops)) for a, ops in members.items()]


@dataclass
class FloatEdit:
    """The config changes that keep some regions in float; `undo()` restores the quantized graph."""

    saved: list[tuple[TensorQuantConfig, QuantState]] = field(default_factory=list)

    def undo(self) -> None:
        for cfg, state in reversed(self.saved):
            cfg.state = state
        self.saved.clear()

    def __enter__(self) -> FloatEdit:
        return self

    def __exit__(self, *exc: object) -> None:
        self.undo()


def keep_float(qgraph: QuantizedGraph, regions: Iterable[Region], weights: bool = True) -> FloatEdit:
    """Keep `regions` in float (see module docstring); returns the edit (a context manager that undoes it).
    weights=False: weight-only, the regions' activations, outputs and biases float, their weights still quantized."""
    edit = FloatEdit()
    ops = {op for r in regions for op in r.ops}
    unknown = sorted(ops - set(qgraph.op_configs))
    if unknown:
        raise ConfigError(f"regions name op(s) not in graph '{qgraph.graph.name}': {', '.join(unknown[:5])}")
    floated: set[int] = set()
    for name in ops:
        oc = qgraph.op_configs[name]
        kept = oc.weight_config() if not weights else None
        for cfg in oc.configs():
            if cfg is kept:
                continue
            if cfg.state is not QuantState.FP32 and cfg.state is not QuantState.SOI:
                edit.saved.append((cfg, cfg.state))
                cfg.state = QuantState.FP32
                floated.add(id(cfg))
    if not floated:
        return edit
    for oc in qgraph.op_configs.values():
        if oc.op.name in ops:
            continue
        for cfg in oc.configs():
            if cfg.state is QuantState.OVERLAPPED and shares_through(cfg, floated):
                edit.saved.append((cfg, cfg.state))
                cfg.state = QuantState.ACTIVATED
    return edit


def overlap_chain(cfg: TensorQuantConfig) -> Iterator[TensorQuantConfig]:
    """The configs cfg shares through dominated_by, nearest first, up to and including the first one that is not
    OVERLAPPED (the live quantizer the chain ends at; at most 1000 links)."""
    c = cfg.dominated_by
    for _ in range(1000):
        if c is None:
            return
        yield c
        if c.state is not QuantState.OVERLAPPED:
            return
        c = c.dominated_by


def shares_through(cfg: TensorQuantConfig, configs: set[int]) -> bool:
    """True if cfg's dominated_by chain passes through one of `configs` (ids) before its live quantizer ends it."""
    return any(id(c) in configs for c in overlap_chain(cfg))


def regions_by_anchor(regions: Sequence[Region]) -> dict[str, Region]:
    return {r.anchor: r for r in regions}
