"""PTQ settings: everything a user can change about one quantization run."""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from netquant.core.spec import Granularity
from netquant.errors import ConfigError
from netquant.passes.calib_ort import CalibEngine
from netquant.passes.overrides import OpSelector, Override
from netquant.platforms import Platform, get_platform
from netquant.platforms.targets import CpuTarget, WeightScheme


class Objective(enum.StrEnum):
    """What automatic placement (analysis.placement) optimises, from per-region INT8 and FP32 times measured in the target
    engine and the output loss of the calibration data.

    LATENCY: the fastest model (every region measured slower in INT8 stays float; no accuracy budget unless max_loss
    is given); BALANCED (default): the model really in INT8, floating only the slower regions needed to be no slower
    than FP32, then (after repair: Effort) the regions whose float saves the most loss until the loss is within max_loss (0.02);
    ACCURACY: INT8 first as BALANCED with a 4x tighter budget, floating the most sensitive regions first.
    """

    LATENCY = "latency"
    BALANCED = "balanced"
    ACCURACY = "accuracy"

    @classmethod
    def parse(cls, value: Objective | str) -> Objective:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"objective must be one of {', '.join(o.value for o in cls)} (or None: the platform's "
                              f"rules only), got {value!r}") from None


class Effort(enum.StrEnum):
    """How much time placement may spend on accuracy before it floats regions (analysis.placement.repair).

    FAST: no repair, regions ranked for floating by their output noise (two fake-quant passes); DEFAULT: the cheap
    repairs (equalization, bias correction where the platform has it off) and the ranking measured on the most
    noisy regions; MAX: every repair (SmoothQuant and AdaRound too) and the ranking measured on every region.
    A fixed amount of work per level, never a clock: the accuracy decisions do not follow the machine's load."""

    FAST = "fast"
    DEFAULT = "default"
    MAX = "max"

    @classmethod
    def parse(cls, value: Effort | str) -> Effort:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"effort must be one of {', '.join(e.value for e in cls)}, got {value!r}") from None


@dataclass(frozen=True)
class LowerIsBetter:
    """A lower-is-better metric as the higher-is-better score placement compares: -metric(outputs, target)."""

    metric: Callable[[Any, Any], float]

    def __call__(self, outputs: Any, target: Any) -> float:
        return -float(self.metric(outputs, target))


@dataclass
class QuantSettings:
    """Settings of quantize_onnx / quantize_torch / `netquant quantize`.

    activation_observer / weight_observer: observer names (netquant.calib registry); None = the
        platform's default.  observer_options: {observer name: {option: value}}.
    per_channel: None = platform default; False forces per-tensor weights.
    force_fp32: op selectors ('Conv', 'name:conv1', 'glob:*head*', 're:^blocks\\.1') left in float.
    overrides: Override objects changing specs of selected ops.
    strict: an op the platform would quantize but cannot stays FP32 with a warning; strict raises.
    target: the CPUs the file will run on (onnxruntime_int8 / openvino_int8): 'any' (default: safe on every
        x86-64 and ARM64 CPU), 'x86-no-vnni', 'x86-vnni', 'arm64' or 'host' (this machine, probed).
    weight_scheme: 'int8', 'int7', 'uint8' or 'int8-pairs'; None = the platform's choice for the target.
    range_bits: significant bits kept of each calibrated activation range end, rounded outward
        (calib.ranges.round_range_outward); makes scales immune to float summation-order noise
        (torch thread count).  None = the observer's exact range.
    bias_correction: fold the mean output shift of weight quantization into the biases
        (passes.bias_correction); None = the platform's default (Platform.bias_correction).
    embeddings: store embedding tables (Gather of a float initializer of at least EMBEDDING_MIN_ELEMENTS) in int8
        with one scale per row (passes.embeddings); None = the platform's default (Platform.embeddings).
    matmul_ranges: clip the activation range of weighted MatMul / Gemm / Attention inputs where that lowers the
        op's output error (passes.matmul_ranges); None = the platform's default (Platform.matmul_ranges).
    objective: automatic placement (Objective; None = the platform's rules only, no measurement).
    max_loss: the accuracy budget of placement: 1 - output cosine vs FP32 by default, or with `metric` the allowed
        drop of metric(outputs, target) on `eval_data` ((inputs, target) pairs), in the metric's units; None = the
        objective's default.
    higher_is_better: `metric` grows with quality (accuracy; the default); False for an error (a loss, WER): then
        max_loss is the allowed rise of the metric.
    placement_from: a placement file (JSON, QuantizedModel.save_placement) to re-apply instead of measuring.
    placement_time_s: cap on placement's profiling and sensitivity seconds (None: 15% of the quantization time
        before it, at least 0.25 s; where the per-region search decides, half of that time, at least 1.5 s). A soft
        cap: the whole-model timings and the FP32 and all-INT8 profiles run whatever it is. It caps latency
        measurements only: the accuracy decisions (repairs, regions floated for the budget) follow `effort`.
    effort: Effort ('fast' | 'default' | 'max'): the repairs placement tries before it floats regions and how many
        regions it measures to rank them.
    calib_stack_mb: batched calibration (passes.calib_stack): equal-shape calibration batches run stacked, as many
        samples as fit this many MiB of observed activations (at most 64), where that leaves every observer's input
        unchanged (order-invariant per-tensor observers, no op mixing the batch dim: checked); 0 = batches as given.
    calib_engine: the engine of FP32 calibration statistics (passes.calib_ort): 'auto' (onnxruntime where stacking is
        ruled out on batches of under 8 samples and it measures faster on the first batches, with the executor's
        scales), 'executor', 'onnxruntime'
        (whenever its first-batch check passes).
    distributed: calibration sharded over the torch.distributed group (passes.distributed; torchrun's variables
        create a gloo group when none exists): every rank passes the same data, runs its share, and the observers are
        merged exactly (order-invariant observers only). Rank 0 places and writes; the other ranks skip placement.
    min_cosine: exports are refused when an output of the file, run in its engine, has a cosine vs the FP32 model
        below this (None: export.fidelity.DEFAULT_MIN_COSINE; -1: never).
    allow_float: accept a result without INT8 regions (or below min_int8_fraction); otherwise quantize_onnx raises
        FloatResultError (objective 'latency' accepts it: its purpose is the fastest file, float or not).
    min_int8_fraction: the share of regions (INT8 or the wider format) below which the result counts as float
        (None: only a result with no such region).
    """

    platform: Platform
    activation_observer: str | None = None
    weight_observer: str | None = None
    observer_options: dict[str, dict[str, Any]] = field(default_factory=dict)
    per_channel: bool | None = None
    force_fp32: tuple[str | OpSelector, ...] = ()
    overrides: tuple[Override, ...] = ()
    strict: bool = False
    quiet: bool = False
    progress: bool = True  # False is the same as quiet=True
    batch_size: int = 16
    max_calib_batches: int | None = None
    flat_ranges: bool = True  # observe max(t, L) where every consumer is flat below L (hard-swish, Relu)
    fold_constants: bool = True
    fold_batchnorm: bool = True
    simplify: bool = True  # exact rewrites: Conv->Mul/Add folding, decomposed hard-swish -> HardSigmoid*x
    device: str = "cpu"
    range_bits: int | None = 8
    bias_correction: bool | None = None  # None: the platform's choice (Platform.bias_correction)
    embeddings: bool | None = None  # None: the platform's choice (Platform.embeddings)
    matmul_ranges: bool | None = None  # None: the platform's choice (Platform.matmul_ranges)
    target: CpuTarget | str | None = None
    weight_scheme: WeightScheme | str | None = None
    objective: Objective | str | None = Objective.BALANCED
    max_loss: float | None = None
    metric: Callable[[Any, Any], float] | None = None
    eval_data: Any = None
    higher_is_better: bool = True
    placement_from: str | os.PathLike[str] | None = None
    placement_time_s: float | None = None
    effort: Effort | str = Effort.DEFAULT
    calib_stack_mb: float = 256.0
    calib_engine: str = "auto"
    distributed: bool = False
    min_cosine: float | None = None
    allow_float: bool = False
    min_int8_fraction: float | None = None

    @classmethod
    def from_kwargs(cls, platform: str | Platform, settings: Mapping[str, Any]) -> QuantSettings:
        """Settings from keyword arguments; unknown keys raise ConfigError listing the valid ones."""
        valid = {f.name for f in fields(cls)} - {"platform"}
        unknown = sorted(set(settings) - valid)
        if unknown:
            raise ConfigError(f"unknown setting(s) {unknown}; valid settings: {', '.join(sorted(valid))}")
        kw = dict(settings)
        for key in ("force_fp32", "overrides"):
            if key in kw:
                value = kw[key]
                kw[key] = (value,) if isinstance(value, (str, OpSelector, Override)) else tuple(value or ())
        s = cls(platform=get_platform(platform), **kw)
        s.validate()
        return s

    def validate(self) -> None:
        if not self.progress:
            self.quiet = True
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ConfigError(f"batch_size must be a positive int, got {self.batch_size!r}")
        if self.range_bits is not None and (not isinstance(self.range_bits, int) or not 2 <= self.range_bits <= 52):
            raise ConfigError(f"range_bits must be None or an int in [2, 52], got {self.range_bits!r}")
        if self.target is not None:
            self.target = CpuTarget.parse(self.target)
        if self.weight_scheme is not None:
            self.weight_scheme = WeightScheme.parse(self.weight_scheme)
        if self.objective is not None:
            self.objective = Objective.parse(self.objective)
        self.effort = Effort.parse(self.effort)
        if self.max_loss is not None and (not isinstance(self.max_loss, (int, float)) or isinstance(self.max_loss, bool)
                                          or not math.isfinite(self.max_loss) or self.max_loss < 0):
            raise ConfigError(f"max_loss (--max-loss) must be None or a finite number >= 0 (1 - output cosine vs "
                              f"FP32, e.g. 0.02), got {self.max_loss!r}")
        if self.objective is None and self.placement_from is None and \
                (self.max_loss is not None or self.metric is not None):
            what = "max_loss (--max-loss)" if self.max_loss is not None else "metric / eval_data"
            raise ConfigError(f"{what} is the accuracy budget of automatic placement, but objective is None "
                              "(--objective none: the platform's rules only, nothing is measured, so the budget would "
                              "be ignored); choose an objective (latency, balanced, accuracy) or drop " + what)
        if self.metric is not None and not callable(self.metric):
            raise ConfigError(f"metric must be a callable metric(outputs, target) -> float, got {self.metric!r}")
        if not isinstance(self.higher_is_better, bool):
            raise ConfigError(f"higher_is_better must be True or False, got {self.higher_is_better!r}")
        if self.metric is not None and not self.higher_is_better and not isinstance(self.metric, LowerIsBetter):
            self.metric = LowerIsBetter(self.metric)  # placement's loss: the drop of a higher-is-better score
        if (self.metric is None) != (self.eval_data is None):
            raise ConfigError("metric and eval_data go together: metric(outputs, target) -> float is averaged over "
                              "eval_data, an iterable of (inputs, target) pairs")
        if self.placement_time_s is not None and self.placement_time_s < 0:
            raise ConfigError(f"placement_time_s must be None or >= 0, got {self.placement_time_s!r}")
        if not isinstance(self.calib_stack_mb, (int, float)) or self.calib_stack_mb < 0:
            raise ConfigError(f"calib_stack_mb must be a number >= 0 (0: no stacking), got {self.calib_stack_mb!r}")
        self.calib_engine = CalibEngine.parse(self.calib_engine).value
        if self.min_cosine is not None and (not isinstance(self.min_cosine, (int, float)) or self.min_cosine != self.min_cosine
                                            or self.min_cosine > 1):
            raise ConfigError(f"min_cosine must be None or a number <= 1 (the lowest output cosine vs FP32 an export "
                              f"may have), got {self.min_cosine!r}")
        if self.min_int8_fraction is not None and (not isinstance(self.min_int8_fraction, (int, float))
                                                   or not 0 <= self.min_int8_fraction <= 1):
            raise ConfigError(f"min_int8_fraction must be None or a number in [0, 1] (the share of regions that must "
                              f"run in INT8), got {self.min_int8_fraction!r}")
        if self.max_calib_batches is not None and self.max_calib_batches < 1:
            raise ConfigError(f"max_calib_batches must be >= 1, got {self.max_calib_batches}")
        from netquant.passes.observers import observer_names

        names = observer_names()
        for what, name in (("activation_observer", self.activation_observer),
                           ("weight_observer", self.weight_observer)):
            if name is not None and name not in names:
                raise ConfigError(f"{what} '{name}' is not a known observer; choose one of {', '.join(names)}")

    def effective_platform(self) -> Platform:
        """The platform with this run's observer / granularity choices applied."""
        p = self.platform.for_cpu(self.target, self.weight_scheme)
        changes: dict[str, Any] = {}
        if self.activation_observer is not None:
            changes["activation_observer"] = self.activation_observer
        if self.weight_observer is not None:
            changes["weight_observer"] = self.weight_observer
        if self.observer_options:
            merged = {k: dict(v) for k, v in p.observer_options.items()}
            for k, v in self.observer_options.items():
                merged.setdefault(k, {}).update(v)
            changes["observer_options"] = merged
        if self.per_channel is False and p.weight.granularity is not Granularity.PER_TENSOR:
            changes["weight"] = p.weight.with_(granularity=Granularity.PER_TENSOR, axis=None, group_size=None)
        elif self.per_channel is True and p.weight.granularity is Granularity.PER_TENSOR:
            changes["weight"] = p.weight.with_(granularity=Granularity.PER_CHANNEL, axis=0)
        return p.with_(**changes) if changes else p
