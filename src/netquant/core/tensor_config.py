"""Per-tensor quantization config: spec + params + state, as the graph layer uses it.

A config's life: INITIAL (waits for calibration) -> ACTIVATED (params set). Configs whose
params are derived from other tensors start PASSIVE_INIT and become PASSIVE. A config that
shares another's params points at it with `dominated_by` (state OVERLAPPED); its effective
params are those at the end of that chain. FP32 and SOI (shape-or-index) tensors stay float.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from netquant.core.int_kernels import PairSumLimit
from netquant.core.qparams import QParams
from netquant.core.spec import QuantSpec
from netquant.errors import ConfigError, ExportError


class QuantState(enum.Enum):
    """Where a tensor's quantization stands."""

    INITIAL = "initial"  # to be calibrated; no params yet
    PASSIVE_INIT = "passive_init"  # params to be derived from other tensors (e.g. bias = s_in * s_w); not yet
    ACTIVATED = "activated"  # calibrated; params in use
    PASSIVE = "passive"  # params derived from other tensors; set
    OVERLAPPED = "overlapped"  # uses the params of the config it is dominated_by
    BAKED = "baked"  # the stored value is already quantized with params (folded weights)
    FP32 = "fp32"  # deliberately left in float
    SOI = "soi"  # shape or index tensor: never quantized

    @property
    def uses_params(self) -> bool:
        """True for the states whose tensor is quantized with params at inference."""
        return self in ACTIVE_STATES

    @property
    def emits(self) -> bool:
        """True for the states that put a quantizer at the tensor's own place (Q/DQ in an export);
        OVERLAPPED uses its dominator's quantizer, the others quantize nothing."""
        return self in EMITTING_STATES

    @property
    def is_pending(self) -> bool:
        """True for the states that still wait for params (not deployable)."""
        return self in PENDING_STATES


# The one definition of what each state means; exporters and passes ask these (or the properties above).
ACTIVE_STATES = frozenset({QuantState.ACTIVATED, QuantState.PASSIVE, QuantState.OVERLAPPED, QuantState.BAKED})
EMITTING_STATES = frozenset({QuantState.ACTIVATED, QuantState.PASSIVE, QuantState.BAKED})
PENDING_STATES = frozenset({QuantState.INITIAL, QuantState.PASSIVE_INIT})


@dataclass(eq=False)
class TensorQuantConfig:
    """How one tensor is quantized. Identity-compared: two configs are equal only if they are one object."""

    spec: QuantSpec
    state: QuantState = QuantState.INITIAL
    observer: str = "minmax"  # name in netquant.calib's observer registry
    params: QParams | None = None
    dominated_by: TensorQuantConfig | None = None  # shares that config's params (shared-scale groups, overlaps)
    name: str = ""  # tensor name, for messages
    pair_limit: PairSumLimit | None = None  # integer codes kept free of int16 pair saturation (weights)

    def __post_init__(self) -> None:
        if not isinstance(self.spec, QuantSpec):
            raise ConfigError(f"TensorQuantConfig {self.label}: spec must be a QuantSpec, got {type(self.spec).__name__}")
        if not isinstance(self.state, QuantState):
            raise ConfigError(f"TensorQuantConfig {self.label}: state must be a QuantState, got {self.state!r}")

    @property
    def label(self) -> str:
        """Name for messages: the tensor name, or the object id if unnamed."""
        return repr(self.name) if self.name else f"<unnamed config at {id(self):#x}>"

    @property
    def root(self) -> TensorQuantConfig:
        """End of the dominated_by chain (self if not dominated). ConfigError on a cycle."""
        seen: list[TensorQuantConfig] = []
        config = self
        while config.dominated_by is not None:
            if any(config is s for s in seen):
                chain = " -> ".join(c.label for c in [*seen, config])
                raise ConfigError(f"dominated_by cycle: {chain}; a config may not (indirectly) dominate itself")
            seen.append(config)
            config = config.dominated_by
        return config

    @property
    def effective_params(self) -> QParams | None:
        """Params in use: those of the root of the dominated_by chain."""
        return self.root.params

    @property
    def effective_pair_limit(self) -> PairSumLimit | None:
        """The pair limit on this config, else on the root of its dominated_by chain."""
        return self.pair_limit or self.root.pair_limit

    @property
    def is_active(self) -> bool:
        """True if the tensor is quantized with params (ACTIVATED, PASSIVE, OVERLAPPED, BAKED)."""
        return self.state.uses_params

    @property
    def emits(self) -> bool:
        """True if the tensor is quantized at this config's own place: an emitting state with effective params."""
        return self.state.emits and self.effective_params is not None

    def overlap_with(self, dominator: TensorQuantConfig) -> None:
        """Share `dominator`'s params from now on: dominated_by = dominator, state = OVERLAPPED.

        Raises ConfigError (and changes nothing) if that would close a cycle.
        """
        if not isinstance(dominator, TensorQuantConfig):
            raise ConfigError(f"{self.label}: can only overlap with a TensorQuantConfig, got {type(dominator).__name__}")
        if dominator.root is self:
            raise ConfigError(f"{self.label} cannot be dominated by {dominator.label}: "
                              f"{dominator.label} already follows {self.label} (that would be a cycle)")
        self.dominated_by = dominator
        self.state = QuantState.OVERLAPPED

    def __repr__(self) -> str:
        dom = f", dominated_by={self.dominated_by.label}" if self.dominated_by is not None else ""
        params = "set" if self.params is not None else "None"
        return (f"TensorQuantConfig({self.label}, {self.state.name}, {self.spec.describe()}, "
                f"observer={self.observer!r}, params={params}{dom})")


def check_deployable(configs: Iterable[TensorQuantConfig]) -> None:
    """Raise ExportError naming every config that cannot be exported.

    Not deployable: INITIAL or PASSIVE_INIT (never calibrated / derived), an active state without
    effective params, or a dominated_by cycle.
    """
    problems: list[str] = []
    for config in configs:
        if config.state.is_pending:
            problems.append(f"{config.label} is {config.state.name}")
            continue
        if not config.is_active:
            continue
        try:
            params = config.effective_params
        except ConfigError as err:
            problems.append(f"{config.label}: {err}")
            continue
        if params is None:
            where = "" if config.root is config else f" (its dominator {config.root.label} has none)"
            problems.append(f"{config.label} is {config.state.name} but has no params{where}")
    if problems:
        raise ExportError(
            f"cannot export: {len(problems)} tensor quantization config(s) are not ready: "
            + "; ".join(problems)
            + ". Calibrate the graph (or set these tensors to FP32) before exporting.")
