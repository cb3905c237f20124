"""Which modules get quantized, and how: ordered wildcard rules and presets.

A rule matches a module when its qualified name matches ``pattern`` and, if ``types`` is given, the
module is an instance of one of them.  Patterns are netquant's one name-pattern language
(netquant.core.selectors, shared with graph PTQ's OpSelector): a bare glob (fnmatch; ``"head.*"`` also
matches ``"head"`` itself), ``"re:<regex>"`` (re.search), ``"name:<exact>"`` or ``"glob:<glob>"``.
The first matching rule wins; a rule with ``layer=None`` keeps the module in FP32.

Weight specs are re-targeted per layer type: PER_CHANNEL uses the layer's output-channel axis
(0 for Linear/Conv/Embedding/LSTM, 1 for ConvTranspose), PER_GROUP its input-channel axis.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from torch import nn

from netquant.calib.ranges import RANGE_MANTISSA_BITS, check_range_bits
from netquant.core import presets
from netquant.core.ops import GradMode
from netquant.core.selectors import NamePattern
from netquant.core.spec import Granularity, QuantSpec
from netquant.errors import ConfigError


@dataclass(frozen=True)
class QuantizerConfig:
    """How one quantization site is quantized.

    ``learnable``: LSQ scale from the start (build the optimizer after calibration);
    ``dynamic``: params from every batch at run time (dynamic quantization);
    ``range_bits``: significant bits kept of a calibrated activation range, rounded outward
    (netquant.calib.ranges, as graph PTQ's QuantSettings.range_bits); None keeps the exact range.
    """

    spec: QuantSpec
    observer: str = "minmax"
    observer_opts: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    learnable: bool = False
    grad_mode: GradMode = GradMode.STE_CLIP
    dynamic: bool = False
    range_bits: int | None = RANGE_MANTISSA_BITS

    def __post_init__(self) -> None:
        if not isinstance(self.spec, QuantSpec):
            raise ConfigError(f"QuantizerConfig.spec must be a QuantSpec, got {type(self.spec).__name__}")
        check_range_bits(self.range_bits, "QuantizerConfig")


@dataclass(frozen=True)
class LayerQuantConfig:
    """Quantizers of one layer; None leaves that tensor in float."""

    weight: QuantizerConfig | None = None
    input: QuantizerConfig | None = None
    output: QuantizerConfig | None = None


@dataclass(frozen=True)
class QuantRule:
    """``pattern`` (a netquant.core.selectors name pattern over the qualified module name) and optional
    ``types`` (module classes, isinstance) -> ``layer``."""

    pattern: str = "*"
    layer: LayerQuantConfig | None = None
    types: tuple[type[nn.Module], ...] = ()

    def __post_init__(self) -> None:
        NamePattern.parse(self.pattern)  # ConfigError for a non-string pattern or a bad regex

    def matches(self, name: str, module: nn.Module) -> bool:
        if self.types and not isinstance(module, self.types):
            return False
        return NamePattern.parse(self.pattern).matches(name)


@dataclass(frozen=True)
class ModelQuantConfig:
    """Ordered rules; the first that matches a module decides its LayerQuantConfig."""

    rules: tuple[QuantRule, ...]
    name: str = "custom"

    def __post_init__(self) -> None:
        for rule in self.rules:
            if not isinstance(rule, QuantRule):
                raise ConfigError(f"ModelQuantConfig '{self.name}': rules must be QuantRule, got {rule!r}")

    def resolve(self, name: str, module: nn.Module) -> LayerQuantConfig | None:
        for rule in self.rules:
            if rule.matches(name, module):
                return rule.layer
        return None

    def prepend(self, *rules: QuantRule) -> ModelQuantConfig:
        """A copy with ``rules`` tried before the existing ones."""
        return replace(self, rules=tuple(rules) + self.rules)

    def keep_float(self, *patterns: str) -> ModelQuantConfig:
        """A copy that leaves modules matching any of ``patterns`` in FP32."""
        return self.prepend(*(QuantRule(pattern=p, layer=None) for p in patterns))

    # ---- presets ---------------------------------------------------------------------------
    @classmethod
    def int8_tensorrt(cls, activation_observer: str = "minmax") -> ModelQuantConfig:
        """INT8 TensorRT (netquant.core.presets.TENSORRT_INT8, the tensorrt_int8 platform's specs): int8
        symmetric narrow range [-127, 127] per-channel weights (axis 0) and per-tensor activations,
        s = amax / 127 for both."""
        weight = QuantizerConfig(presets.TENSORRT_INT8.weight)
        act = QuantizerConfig(presets.TENSORRT_INT8.activation, observer=activation_observer)
        return cls((QuantRule(layer=LayerQuantConfig(weight=weight, input=act)),), name="int8_tensorrt")

    @classmethod
    def w8a8(cls, activation_observer: str = "minmax") -> ModelQuantConfig:
        """Alias of int8_tensorrt."""
        return cls.int8_tensorrt(activation_observer)

    @classmethod
    def w4a16(cls, group_size: int = 128) -> ModelQuantConfig:
        """Weight-only int4: symmetric per-group (along the input axis) for Linear/Embedding,
        per-channel for convolutions and LSTM; activations stay float."""
        grouped = QuantizerConfig(QuantSpec.int4_per_group(group_size=group_size, axis=1))
        per_channel = QuantizerConfig(QuantSpec(bits=4, granularity=Granularity.PER_CHANNEL, axis=0,
                                                narrow_range=True))
        return cls((QuantRule(types=(nn.Linear, nn.Embedding), layer=LayerQuantConfig(weight=grouped)),
                    QuantRule(layer=LayerQuantConfig(weight=per_channel))), name="w4a16")

    @classmethod
    def w4a4(cls, activation_observer: str = "mse") -> ModelQuantConfig:
        """int4 symmetric per-channel weights, uint4 affine per-tensor activations."""
        weight = QuantizerConfig(QuantSpec(bits=4, granularity=Granularity.PER_CHANNEL, axis=0,
                                           narrow_range=True))
        act = QuantizerConfig(QuantSpec(bits=4, signed=False, symmetric=False), observer=activation_observer)
        return cls((QuantRule(layer=LayerQuantConfig(weight=weight, input=act)),), name="w4a4")

    @classmethod
    def fp8(cls) -> ModelQuantConfig:
        """FP8 E4M3 (the specs of the fp8_e4m3 platform, netquant.core.presets.FP8_E4M3): per-channel scaled
        weights, per-tensor scaled activations."""
        weight = QuantizerConfig(presets.FP8_E4M3.weight)
        act = QuantizerConfig(presets.FP8_E4M3.activation)
        return cls((QuantRule(layer=LayerQuantConfig(weight=weight, input=act)),), name="fp8")


def dynamic_config(weight_spec: QuantSpec | None = None,
                   activation_spec: QuantSpec | None = None) -> ModelQuantConfig:
    """Dynamic quantization of Linear and LSTM: int8 weights, activations quantized per batch."""
    weight = QuantizerConfig(weight_spec or QuantSpec.int8_per_channel(axis=0, narrow_range=True))
    act = QuantizerConfig(activation_spec or QuantSpec.uint8_affine(), dynamic=True)
    layer = LayerQuantConfig(weight=weight, input=act)
    return ModelQuantConfig((QuantRule(types=(nn.Linear, nn.LSTM), layer=layer),), name="dynamic")
