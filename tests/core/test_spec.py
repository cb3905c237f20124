"""QuantSpec: derived integer ranges, storage dtypes, presets, and invalid combinations."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from netquant.core.spec import Granularity, QuantFormat, QuantSpec, RoundingPolicy, ScaleConstraint
from netquant.errors import ConfigError


@pytest.mark.parametrize(
    ("kw", "qmin", "qmax", "dtype"),
    [
        ({"bits": 8}, -128, 127, torch.int8),
        ({"bits": 8, "narrow_range": True}, -127, 127, torch.int8),
        ({"bits": 8, "signed": False}, 0, 255, torch.uint8),
        ({"bits": 8, "signed": False, "narrow_range": True}, 0, 254, torch.uint8),
        ({"bits": 4}, -8, 7, torch.int8),
        ({"bits": 2, "signed": False}, 0, 3, torch.uint8),
        ({"bits": 16}, -32768, 32767, torch.int16),
        ({"bits": 16, "signed": False}, 0, 65535, torch.int32),
        ({"bits": 12, "signed": False}, 0, 4095, torch.int16),
        ({"bits": 8, "quant_min": -100, "quant_max": 100}, -100, 100, torch.int8),
        ({"bits": 32}, -(2**31), 2**31 - 1, torch.int32),
    ],
)
def test_integer_ranges_and_storage(kw: dict, qmin: int, qmax: int, dtype: torch.dtype) -> None:
    spec = QuantSpec(**kw)
    assert (spec.qmin, spec.qmax, spec.storage_dtype) == (qmin, qmax, dtype)
    assert not spec.is_float


def test_fp8_formats() -> None:
    e4, e5 = QuantSpec.fp8_e4m3(), QuantSpec.fp8_e5m2()
    assert e4.is_float and e4.fp_max == 448.0 and e4.storage_dtype == torch.float8_e4m3fn
    assert e5.fp_max == 57344.0 and e5.storage_dtype == torch.float8_e5m2
    assert e4.fp_max == torch.finfo(torch.float8_e4m3fn).max
    assert e5.fp_max == torch.finfo(torch.float8_e5m2).max
    assert e4.fmt is QuantFormat.FP8_E4M3


def test_presets_accept_overrides() -> None:
    spec = QuantSpec.int8_per_channel(axis=1, symmetric=False, rounding=RoundingPolicy.ROUND_HALF_UP)
    assert spec.granularity is Granularity.PER_CHANNEL and spec.axis == 1 and not spec.symmetric
    assert QuantSpec.uint8_affine(narrow_range=True).qmax == 254
    g = QuantSpec.int4_per_group(group_size=64, axis=0, signed=False)
    assert (g.group_size, g.axis, g.qmin, g.qmax) == (64, 0, 0, 15)
    assert QuantSpec.fp8_e4m3(scale_constraint=ScaleConstraint.POWER_OF_TWO).scale_constraint is \
        ScaleConstraint.POWER_OF_TWO


def test_frozen_hashable_and_with_revalidates() -> None:
    spec = QuantSpec.int8()
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.bits = 4  # type: ignore[misc]
    assert hash(spec) == hash(QuantSpec.int8())
    assert spec.with_(bits=4).qmax == 7
    with pytest.raises(ConfigError):
        spec.with_(bits=1)


def test_describe_is_readable() -> None:
    text = QuantSpec.int4_per_group(group_size=32, axis=1, scale_constraint=ScaleConstraint.POWER_OF_TWO).describe()
    assert text == "int4, sym, per_group, axis=1, group=32, pow2, ROUND_HALF_EVEN"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"bits": 1}, "bits must be between 2 and 16"),
        ({"bits": 17}, "bits must be between 2 and 16"),
        ({"bits": 8.0}, "bits must be an int"),
        ({"bits": True}, "bits must be an int"),
        ({"quant_min": -5}, "give both quant_min and quant_max"),
        ({"quant_min": -200, "quant_max": 100}, "quant_min < quant_max"),
        ({"quant_min": 5, "quant_max": 5}, "quant_min < quant_max"),
        ({"axis": 0}, "per-tensor specs take no axis"),
        ({"granularity": Granularity.PER_CHANNEL}, "needs an axis"),
        ({"granularity": Granularity.PER_CHANNEL, "axis": 0, "group_size": 4}, "per-channel specs take no group_size"),
        ({"granularity": Granularity.PER_GROUP, "axis": 0}, "group_size >= 1"),
        ({"granularity": Granularity.PER_GROUP, "axis": 0, "group_size": 0}, "group_size >= 1"),
        ({"fmt": QuantFormat.FP8_E4M3, "bits": 4}, "8-bit format"),
        ({"fmt": QuantFormat.FP8_E4M3, "symmetric": False}, "signed symmetric"),
        ({"fmt": QuantFormat.FP8_E5M2, "signed": False}, "signed symmetric"),
        ({"fmt": QuantFormat.FP8_E4M3, "quant_min": -1, "quant_max": 1}, "do not apply to FP8"),
        ({"fmt": QuantFormat.FP8_E4M3, "rounding": RoundingPolicy.ROUND_UP}, "round half to even"),
        ({"fmt": QuantFormat.FP8_E4M3, "narrow_range": True}, "integer formats only"),
    ],
)
def test_invalid_combinations_raise_config_error(kw: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        QuantSpec(**kw)
    assert "invalid QuantSpec(" in str(info.value)
