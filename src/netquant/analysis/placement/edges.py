"""Edge floats: the first / last projection and small embedding tables kept float where that is nearly free and
buys much accuracy.

A region is an edge candidate when its weights are at most EDGE_MAX_WEIGHT_SHARE of all the regions' weights and
either its anchor is a Conv / MatMul / Gemm that reads a model input (ViT's patch embedding reading the pixels, an
audio encoder's first Conv reading the features; through Reshape / Transpose / Unsqueeze / Squeeze / Flatten /
Identity / Cast) or writes a model output (a classifier head, through the same ops), or it is a Gather of a constant
table (a position or token-type embedding: float, its lookup is no slower, and the file grows by 3 bytes per
element). A compute candidate's weight share is about its share of the multiply-adds where every weight is used
about as often (per token or pixel position): floating it costs at most that share of the INT8 speed-up. A candidate
is kept float when the accuracy budget's meter (fake quantization, one torch thread, the budget's samples) measures
that floating it alone saves at least EDGE_MIN_GAIN of the all-INT8 loss: an input quantized per tensor over a wide
dynamic range (pixels, log-mel features), or a table whose per-row int8 error every token carries, can hold a large
share of the whole model's error. A table's bar is TABLE_MIN_GAIN under BALANCED (the default): a float table costs 3
bytes per element where the file is meant to be small, so a table saving less stays int8 per row and is recorded as
such (`int8_table`), with what floating it would save; ACCURACY floats it from EDGE_MIN_GAIN. A Conv / MatMul / Gemm
edge is kept weight-only instead (its activations float, its weights int8 behind a DequantizeLinear: the file 3 bytes
per weight smaller than float) where that keeps at least
WEIGHT_ONLY_SHARE of what floating it saves and it holds WEIGHT_ONLY_MIN_WEIGHTS or more (smaller ones, a CNN's first
conv, save a few KB: they stay float). No clock enters the choice: the same model, data and settings give the
same edge floats.
"""

from __future__ import annotations

from dataclasses import dataclass

from netquant.analysis.placement.constants import (
    EDGE_MAX_WEIGHT_SHARE,
    EDGE_MIN_GAIN,
    TABLE_MIN_GAIN,
    WEIGHT_ONLY_SHARE,
)
from netquant.analysis.placement.records import significant
from netquant.analysis.regions import Region
from netquant.graph import Graph
from netquant.passes.settings import Objective

EDGE_OPS = ("Conv", "MatMul", "Gemm")
_PASS_THROUGH = ("Reshape", "Transpose", "Unsqueeze", "Squeeze", "Flatten", "Identity", "Cast")


def min_gain(op_type: str, objective: Objective) -> float:
    """The share of the all-INT8 loss floating an edge region must save to stay float: TABLE_MIN_GAIN for a table
    (Gather) under BALANCED, else EDGE_MIN_GAIN."""
    return TABLE_MIN_GAIN if op_type == "Gather" and objective is Objective.BALANCED else EDGE_MIN_GAIN


@dataclass(frozen=True)
class EdgeFloat:
    """One edge region kept float, or weight-only (int8 weights, float activations), or a table kept int8 though
    floating it saves EDGE_MIN_GAIN (`int8_table`: under TABLE_MIN_GAIN, BALANCED): its share of the compute
    weights, the all-INT8 loss, the loss with it float and (Conv / MatMul / Gemm) with it weight-only."""

    anchor: str
    weight_share: float
    loss_all_int8: float
    loss_float: float
    loss_weight_only: float | None = None
    int8_table: bool = False

    @property
    def floated(self) -> bool:
        """Kept float: neither weight-only nor a table kept int8."""
        return not self.weight_only and not self.int8_table

    @property
    def weight_only(self) -> bool:
        """Weight-only keeps at least WEIGHT_ONLY_SHARE of what floating saves (and saves EDGE_MIN_GAIN itself)."""
        lw, base = self.loss_weight_only, self.loss_all_int8
        return lw is not None and base - lw >= EDGE_MIN_GAIN * base and \
            base - lw >= WEIGHT_ONLY_SHARE * (base - self.loss_float)

    def as_dict(self) -> dict[str, float | bool]:
        out: dict[str, float | bool] = {"weight_share": significant(self.weight_share, 4),
                                        "loss_all_int8": significant(self.loss_all_int8),
                                        "loss_float": significant(self.loss_float)}
        if self.loss_weight_only is not None:
            out.update({"loss_weight_only": significant(self.loss_weight_only), "weight_only": self.weight_only})
        if self.int8_table:
            out["int8_table"] = True
        return out


def region_weight_count(graph: Graph, region: Region) -> int:
    """Elements of the region's constant inputs (its weights and biases)."""
    return sum(int(graph.initializers[i].numel()) for op in region.ops for i in graph.node(op).inputs
               if i in graph.initializers)


def _reads_input(graph: Graph, tensor: str, inputs: set[str]) -> bool:
    for _ in range(8):
        if tensor in inputs:
            return True
        node = graph.producer(tensor)
        if node is None or node.op_type not in _PASS_THROUGH or not node.inputs:
            return False
        tensor = node.inputs[0]
    return False


def _writes_output(graph: Graph, tensor: str, outputs: set[str]) -> bool:
    frontier = [tensor]
    for _ in range(8):
        if any(t in outputs for t in frontier):
            return True
        nxt = []
        for t in frontier:
            readers = graph.consumers(t)
            if not readers or any(r.op_type not in _PASS_THROUGH for r in readers):
                return False
            nxt += [r.outputs[0] for r in readers if r.outputs]
        frontier = nxt
    return False


def edge_candidates(graph: Graph, regions: list[Region]) -> dict[str, float]:
    """{anchor: weight share} of the edge candidates (module docstring), in graph order."""
    total = sum(region_weight_count(graph, r) for r in regions)
    if not total:
        return {}
    inputs = {v.name for v in graph.inputs if v.name not in graph.initializers}
    outputs = {v.name for v in graph.outputs}
    out: dict[str, float] = {}
    for r in regions:
        share = region_weight_count(graph, r) / total
        node = graph.node(r.anchor)
        if share > EDGE_MAX_WEIGHT_SHARE or not node.inputs or not share:
            continue
        if r.op_type == "Gather":
            if node.inputs[0] in graph.initializers:
                out[r.anchor] = share
        elif r.op_type in EDGE_OPS and (_reads_input(graph, node.inputs[0], inputs) or
                                        _writes_output(graph, graph.node(r.ops[-1]).outputs[0], outputs)):
            out[r.anchor] = share
    return out
