"""The PTQ pipeline: clean-up, data check, configs, calibration, alignment, bias, deployability check."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from netquant.graph import Graph
from netquant.passes.alignment import AlignmentPass
from netquant.passes.base import PassBase, PassContext, Stage
from netquant.passes.bias import BiasPass
from netquant.passes.bias_correction import BiasCorrectionPass
from netquant.passes.build_configs import BuildConfigsPass
from netquant.passes.calib_data import CalibrationData
from netquant.passes.calibration import CalibrationPass
from netquant.passes.check import DeployabilityCheck
from netquant.passes.check_data import CheckDataPass
from netquant.passes.cleanup import CleanupPass
from netquant.passes.embeddings import EmbeddingPass
from netquant.passes.manager import PassManager
from netquant.passes.matmul_ranges import MatMulRangesPass
from netquant.passes.progress import make_progress
from netquant.passes.quant_graph import QuantizedGraph
from netquant.passes.settings import QuantSettings


def default_passes(settings: QuantSettings, calib_data: Any, extra: Sequence[PassBase] = ()) -> list[PassBase]:
    """The default PTQ passes; each `extra` pass runs where its `stage` says (Stage; in the given order within a
    stage): GRAPH after the data check, before configs are built; WEIGHTS after bias quantization, before bias
    correction; QUANTIZED after bias correction, before the final deployability check."""

    def staged(stage: Stage) -> list[PassBase]:
        return [p for p in extra if getattr(p, "stage", Stage.QUANTIZED) is stage]

    return [
        CleanupPass(settings.fold_constants, settings.fold_batchnorm, settings.simplify),
        CheckDataPass(calib_data),
        *staged(Stage.GRAPH),
        BuildConfigsPass(),
        CalibrationPass(),
        *([MatMulRangesPass()] if _matmul_ranges(settings) else []),
        AlignmentPass(),
        BiasPass(),
        *staged(Stage.WEIGHTS),
        BiasCorrectionPass(),
        EmbeddingPass(),
        *staged(Stage.QUANTIZED),
        DeployabilityCheck(),
    ]


def _matmul_ranges(settings: QuantSettings) -> bool:
    """The settings' matmul_ranges choice, else the platform's."""
    return bool(settings.matmul_ranges if settings.matmul_ranges is not None else settings.platform.matmul_ranges)


@dataclass
class PTQRun:
    """What one run of the PTQ passes leaves: the quantized graph, the wall seconds of each pass, and the
    calibration data as CheckDataPass validated it (re-iterable unless it was streamed from an iterator)."""

    qgraph: QuantizedGraph
    timings: dict[str, float]
    calib_data: CalibrationData | None


def run_ptq(graph: Graph, calib_data: Any, settings: QuantSettings, extra_passes: Sequence[PassBase] = ()) -> PTQRun:
    """Run the default passes (plus `extra_passes`, see default_passes) on `graph` (edited in place).

    The calibration data is validated here, once (CheckDataPass: DataError / CalibrationError naming the
    input); callers use PTQRun.calib_data rather than checking it again."""
    ctx = PassContext(settings=settings, graph=graph, progress=make_progress(settings.quiet))
    PassManager(default_passes(settings, calib_data, extra_passes)).run(ctx)
    qgraph = ctx.quantized
    qgraph.cleanup = ctx.cleanup
    qgraph.repairs = list(ctx.repairs)
    qgraph.timings = dict(ctx.timings)
    return PTQRun(qgraph, ctx.timings, ctx.calib_data)


def quantize_graph(graph: Graph, calib_data: Any, settings: QuantSettings,
                   extra_passes: Sequence[PassBase] = ()) -> tuple[QuantizedGraph, dict[str, float]]:
    """run_ptq's quantized graph and pass timings."""
    run = run_ptq(graph, calib_data, settings, extra_passes)
    return run.qgraph, run.timings
