"""The PTQ pipeline: clean-up, configs, calibration, alignment, bias, check."""

from __future__ import annotations

from typing import Any

from netquant.graph import Graph
from netquant.passes.alignment import AlignmentPass
from netquant.passes.bias import BiasPass
from netquant.passes.calib_data import CalibrationData
from netquant.passes.calibration import CalibrationPass
from netquant.passes.check import DeployabilityCheck
from netquant.passes.cleanup import CleanupPass
from netquant.passes.overrides import resolve_overrides
from netquant.passes.pipeline import PassContext, make_progress, run_passes
from netquant.passes.quant_graph import QuantizedGraph
from netquant.passes.quantizer import build_quant_graph
from netquant.passes.settings import QuantSettings


class BuildConfigsPass:
    """Build a config for every input / output of every op from the platform rules."""

    name = "quantization configs"

    def run(self, ctx: PassContext) -> None:
        s: QuantSettings = ctx.settings
        overrides = resolve_overrides(ctx.graph, s.force_fp32, s.overrides)
        ctx.qgraph = build_quant_graph(ctx.graph, s.effective_platform(), overrides, strict=s.strict)


class CheckDataPass:
    """Validate the calibration data against the model inputs (before any heavy work)."""

    name = "calibration data"

    def __init__(self, data: Any) -> None:
        self.data = data

    def run(self, ctx: PassContext) -> None:
        s: QuantSettings = ctx.settings
        ctx.calib_data = CalibrationData(ctx.graph, self.data, batch_size=s.batch_size,
                                         max_batches=s.max_calib_batches)


def default_passes(settings: QuantSettings, calib_data: Any) -> list[Any]:
    return [
        CleanupPass(settings.fold_constants, settings.fold_batchnorm, settings.simplify),
        CheckDataPass(calib_data),
        BuildConfigsPass(),
        CalibrationPass(),
        AlignmentPass(),
        BiasPass(),
        DeployabilityCheck(),
    ]


def quantize_graph(graph: Graph, calib_data: Any, settings: QuantSettings) -> tuple[QuantizedGraph, dict[str, float]]:
    """Run the default passes on `graph` (edited in place); returns the quantized graph and timings."""
    ctx = PassContext(settings=settings, graph=graph, progress=make_progress(settings.quiet))
    run_passes(default_passes(settings, calib_data), ctx)
    ctx.qgraph.info["timings"] = dict(ctx.timings)
    return ctx.qgraph, ctx.timings
