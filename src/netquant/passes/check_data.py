"""Validate the calibration data against the model inputs (before any heavy work).

This is netquant's one validation of PTQ calibration data: quantize_onnx / quantize_torch / the CLI do
not check it themselves, they keep what this pass validated (passes.ptq.PTQRun.calib_data)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from netquant.graph import Graph
from netquant.graph.shape_inference import infer_graph_shapes
from netquant.passes.base import Condition, PassBase, PassContext
from netquant.passes.calib_data import CalibrationData


@dataclass
class CheckDataPass(PassBase):
    """Sets ctx.calib_data from `data` (DataError naming the input if it does not fit the model)."""

    data: Any
    name: ClassVar[str] = "calibration data"
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.GRAPH})
    ensures: ClassVar[frozenset[Condition]] = frozenset({Condition.CALIB_DATA})

    def run(self, ctx: PassContext) -> None:
        s = ctx.settings
        ctx.calib_data = CalibrationData(ctx.graph, self.data, batch_size=s.batch_size,
                                         max_batches=s.max_calib_batches)
        _rank_shapeless_inputs(ctx.graph, ctx.calib_data)


def _rank_shapeless_inputs(graph: Graph, data: CalibrationData) -> None:
    """Inputs declared without a shape (onnxruntime runs them, onnx.checker refuses them in an export) get the rank of
    the calibration data with unknown dims, and shape inference runs again so the outputs get their ranks too."""
    if data.num_batches is None:  # a one-shot stream: not peeked at
        return
    first = next(iter(data))
    changed = False
    for v in graph.inputs:
        if v.shape is None and v.type_proto is None and v.name in first:
            v.shape = (None,) * first[v.name].dim()
            changed = True
    if changed:
        infer_graph_shapes(graph)
