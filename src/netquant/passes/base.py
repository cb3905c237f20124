"""The pass contract: `PassBase` declares what a pass requires of the run state and what it ensures;
`PassContext` is that state; `Condition` names the facts, each with a check the pass manager runs
before (requires) and after (ensures) every pass."""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import ClassVar, TypeVar

from netquant.core.tensor_config import QuantState, TensorQuantConfig
from netquant.errors import ConfigError
from netquant.graph import Graph
from netquant.graph.op_config import TensorRole
from netquant.passes.calib_data import CalibrationData
from netquant.passes.progress import ProgressReporter
from netquant.passes.quant_graph import CleanupCounts, QuantizedGraph, RepairRecord
from netquant.passes.settings import QuantSettings

T = TypeVar("T")


class Stage(enum.Enum):
    """Where a user pass (`quantize_onnx(passes=...)`) runs in the PTQ pipeline (passes.ptq.default_passes).

    GRAPH: rewrites the FP32 graph (exactly) before configs are built and weights and activations calibrated,
    after clean-up and the data check (equalization, SmoothQuant); WEIGHTS: after bias quantization, when every
    weight scale is final, before bias correction (AdaRound); QUANTIZED (default): after bias correction, before
    the deployability check."""

    GRAPH = "graph"
    WEIGHTS = "weights"
    QUANTIZED = "quantized"


class PassConditionError(ConfigError):
    """A pass ran without a condition it requires, or did not establish one it ensures."""


@dataclass
class PassContext:
    """State shared by the passes of one run (each field written by the pass that ensures it)."""

    settings: QuantSettings
    graph: Graph
    qgraph: QuantizedGraph | None = None  # Condition.CONFIGS
    calib_data: CalibrationData | None = None  # Condition.CALIB_DATA
    progress: ProgressReporter = field(default_factory=ProgressReporter)
    timings: dict[str, float] = field(default_factory=dict)  # pass name -> wall seconds
    cleanup: CleanupCounts = field(default_factory=CleanupCounts)  # what the clean-up pass did
    repairs: list[RepairRecord] = field(default_factory=list)  # what the repair passes changed (in run order)

    @property
    def quantized(self) -> QuantizedGraph:
        """The quantized graph; PassConditionError if no pass has built it yet."""
        if self.qgraph is None:
            raise PassConditionError("no quantized graph yet: run BuildConfigsPass before this pass")
        return self.qgraph

    def track(self, items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
        """Iterate `items`, reporting progress through the run's reporter."""
        return self.progress.track(items, description, total)


def _unmet_graph(ctx: PassContext) -> str | None:
    return None if isinstance(ctx.graph, Graph) else "the context holds no netquant Graph"


def _unmet_calib_data(ctx: PassContext) -> str | None:
    return None if ctx.calib_data is not None else "no validated calibration data (CheckDataPass)"


def _unmet_configs(ctx: PassContext) -> str | None:
    return None if ctx.qgraph is not None else "no quantized graph (BuildConfigsPass)"


def _first(ctx: PassContext, bad: str, pred: Callable[[TensorQuantConfig], bool]) -> str | None:
    """`bad`, naming the first config for which `pred` holds (None if there is none)."""
    if ctx.qgraph is None:
        return "no quantized graph (BuildConfigsPass)"
    for cfg in ctx.qgraph.configs():
        if pred(cfg):
            return f"config of tensor '{cfg.name}' {bad}"
    return None


def _unmet_calibrated(ctx: PassContext) -> str | None:
    return _first(ctx, "is still INITIAL without params (CalibrationPass)",
                  lambda c: c.state is QuantState.INITIAL and c.dominated_by is None)


def _unmet_aligned(ctx: PassContext) -> str | None:
    return _first(ctx, "shares params but is still INITIAL (AlignmentPass)",
                  lambda c: c.state is QuantState.INITIAL and c.dominated_by is not None)


def _unmet_biases(ctx: PassContext) -> str | None:
    if ctx.qgraph is None:
        return "no quantized graph (BuildConfigsPass)"
    for oc in ctx.qgraph.op_configs.values():
        i = oc.input_index(TensorRole.BIAS)
        cfg = oc.inputs[i] if i is not None else None
        if cfg is not None and cfg.state is QuantState.PASSIVE_INIT:
            return f"bias '{cfg.name}' of '{oc.op.name}' is still PASSIVE_INIT (BiasPass)"
    return None


def _unmet_deployable(ctx: PassContext) -> str | None:
    return _first(ctx, "is not deployable (DeployabilityCheck)",
                  lambda c: c.state in (QuantState.INITIAL, QuantState.PASSIVE_INIT))


class Condition(enum.Enum):
    """A fact about the run state that a pass may require or ensure."""

    GRAPH = "graph"  # ctx.graph is a netquant Graph
    CALIB_DATA = "calibration data"  # ctx.calib_data validated against the model inputs
    CONFIGS = "quantization configs"  # ctx.qgraph built: a config on every op input and output
    CALIBRATED = "calibrated"  # no config without params left to observe
    ALIGNED = "aligned"  # configs sharing params (shared-scale groups, siblings) activated
    BIASES = "biases derived"  # no bias config waiting for its derived params
    DEPLOYABLE = "deployable"  # no INITIAL / PASSIVE_INIT config left

    def unmet(self, ctx: PassContext) -> str | None:
        """Why this condition does not hold in `ctx` (None when it holds)."""
        return _CHECKS[self](ctx)


_CHECKS = {
    Condition.GRAPH: _unmet_graph,
    Condition.CALIB_DATA: _unmet_calib_data,
    Condition.CONFIGS: _unmet_configs,
    Condition.CALIBRATED: _unmet_calibrated,
    Condition.ALIGNED: _unmet_aligned,
    Condition.BIASES: _unmet_biases,
    Condition.DEPLOYABLE: _unmet_deployable,
}


class PassBase(ABC):
    """One step of a pass run: `run` edits the context; `requires` must hold before, `ensures` after.

    Subclasses set the class attributes `name` (unique in a run: it keys the timings), `requires` and
    `ensures` (and `stage`, where a user pass runs: Stage), and implement `run`.
    """

    name: ClassVar[str]
    stage: ClassVar[Stage] = Stage.QUANTIZED
    requires: ClassVar[frozenset[Condition]] = frozenset()
    ensures: ClassVar[frozenset[Condition]] = frozenset()

    @abstractmethod
    def run(self, ctx: PassContext) -> None:
        """Apply this pass to `ctx` (in place)."""

    def check(self, ctx: PassContext, conditions: frozenset[Condition], when: str) -> None:
        """PassConditionError naming this pass and the first condition of `conditions` unmet in `ctx`."""
        for cond in sorted(conditions, key=lambda c: list(Condition).index(c)):
            why = cond.unmet(ctx)
            if why is not None:
                fix = ("put the passes that ensure it earlier in the list" if when == "before"
                       else "fix the pass or drop the condition from its ensures")
                raise PassConditionError(f"pass '{self.name}' ({type(self).__name__}) {when}: condition "
                                         f"'{cond.value}' does not hold: {why}; {fix}")
