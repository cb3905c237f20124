"""The clipped MatMul input ranges (passes.matmul_ranges) checked against the model's output: kept only where the
accuracy budget's all-INT8 loss is lower with them than with the min / max ranges (one more fake-quant pass on the
budget's samples, one torch thread: deterministic); recorded as Placement.measured['matmul_ranges']."""

from __future__ import annotations

from typing import Any

from netquant.analysis.placement.budget import AccuracyBudget, meter_loss
from netquant.analysis.placement.records import significant
from netquant.passes.matmul_ranges import NAME
from netquant.passes.quant_graph import QuantizedGraph


def check_clipped_ranges(budget: AccuracyBudget) -> dict[str, Any] | None:
    """Keep or undo the graph's clipped ranges (module docstring); None where there are none or no budget."""
    qgraph = budget.s.qgraph
    clips = list(qgraph.clipped_ranges)
    if not clips or budget.meter is None:
        return None
    clipped = budget.loss(set())  # the graph as the pass left it
    for c in clips:
        c.config.params = c.min_max
    min_max = meter_loss(budget.meter, [])
    keep = clipped < min_max
    if keep:
        for c in clips:
            c.config.params = c.clipped  # (both runs are kept under their quant states for export validation)
    else:
        budget.loss_of[frozenset()] = min_max
        undo(qgraph)
    return {"tensors": len(clips), "loss_clipped": significant(clipped), "loss_min_max": significant(min_max), "kept": keep}


def reapply_clipped_ranges(qgraph: QuantizedGraph, measured: dict[str, Any]) -> None:
    """A placement file's choice on a graph quantized again (placement_from): the min / max ranges where the file
    says the clipped ones were not kept (no record: kept, as passes.matmul_ranges left them)."""
    record = measured.get("matmul_ranges")
    if isinstance(record, dict) and record.get("kept") is False:
        undo(qgraph)


def undo(qgraph: QuantizedGraph) -> None:
    """The min / max params back on every clipped config, the pass's records dropped."""
    for c in qgraph.clipped_ranges:
        c.config.params = c.min_max
    qgraph.clipped_ranges = []
    qgraph.repairs = [r for r in qgraph.repairs if r.repair != NAME]
