"""core.presets: one definition per named scheme, used by the platforms and the nn presets alike."""

from __future__ import annotations

from netquant.core import presets
from netquant.core.spec import QuantSpec
from netquant.nn import ModelQuantConfig
from netquant.platforms import get_platform


def test_tensorrt_int8_is_one_thing() -> None:
    trt = get_platform("tensorrt_int8")
    layer = ModelQuantConfig.int8_tensorrt().rules[0].layer
    assert trt.weight == layer.weight.spec == presets.TENSORRT_INT8.weight
    assert trt.weight == QuantSpec.int8_per_channel(axis=0, narrow_range=True)
    assert trt.activation == layer.input.spec == presets.TENSORRT_INT8.activation
    assert trt.activation == QuantSpec.int8(narrow_range=True)  # s = amax / 127, codes [-127, 127]


def test_fp8_is_one_thing() -> None:
    fp8 = get_platform("fp8_e4m3")
    layer = ModelQuantConfig.fp8().rules[0].layer
    assert fp8.activation == layer.input.spec == presets.FP8_E4M3.activation
    assert fp8.weight == layer.weight.spec == presets.FP8_E4M3.weight
