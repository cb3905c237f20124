"""Named quantization schemes, defined once and used by both workflows.

The graph platforms (`netquant.platforms.builtin`) and the module presets (`netquant.nn.ModelQuantConfig`)
take their activation and weight specs from here, so a name such as "TensorRT int8" means one thing.
"""

from __future__ import annotations

from dataclasses import dataclass

from netquant.core.spec import Granularity, QuantSpec


@dataclass(frozen=True)
class Scheme:
    """The specs of one target: per-tensor activations, per-channel weights (output channels on axis 0)."""

    activation: QuantSpec
    weight: QuantSpec


# TensorRT explicit int8: symmetric int8 with scale amax / 127 (the calibration cache's encoding), so the
# narrow range [-127, 127] for activations and weights alike; per-channel weights.
TENSORRT_INT8 = Scheme(
    activation=QuantSpec.int8(narrow_range=True),
    weight=QuantSpec.int8_per_channel(axis=0, narrow_range=True),
)

# FP8 E4M3 (scaled, saturating): per-tensor activations, per-channel weights.
FP8_E4M3 = Scheme(
    activation=QuantSpec.fp8_e4m3(),
    weight=QuantSpec.fp8_e4m3(granularity=Granularity.PER_CHANNEL, axis=0),
)
