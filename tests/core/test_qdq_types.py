"""core.qdq_types: the ONNX Q/DQ type, opset and clamp of a spec, shared by both exporters."""

from __future__ import annotations

import pytest
from onnx import TensorProto as T

from netquant.core.qdq_types import clip_range, qdq_min_opset, smallest_int_type
from netquant.core.spec import Granularity, QuantSpec


@pytest.mark.parametrize(("spec", "opset", "expected"), [
    (QuantSpec.int8(), 13, T.INT8),
    (QuantSpec.uint8_affine(), 13, T.UINT8),
    (QuantSpec(bits=4, signed=False, symmetric=False), 18, T.INT8),  # no 4-bit types before opset 21
    (QuantSpec(bits=4, signed=False, symmetric=False), 21, T.UINT4),
    (QuantSpec(bits=16), 18, None),
    (QuantSpec(bits=16), 21, T.INT16),
])
def test_smallest_int_type(spec: QuantSpec, opset: int, expected: int | None) -> None:
    assert smallest_int_type(spec, opset) == expected


def test_min_opset() -> None:
    assert qdq_min_opset(T.INT8, QuantSpec.int8()) == 13
    assert qdq_min_opset(T.FLOAT8E4M3FN, QuantSpec.fp8_e4m3()) == 19
    assert qdq_min_opset(T.INT16, QuantSpec(bits=16)) == 21
    assert qdq_min_opset(T.INT8, QuantSpec.int4_per_group(group_size=32, axis=1)) == 21
    assert qdq_min_opset(T.INT32, QuantSpec(bits=32, granularity=Granularity.PER_CHANNEL, axis=0)) == 13


def test_clip_range() -> None:
    assert clip_range(QuantSpec.int8(), T.INT8) is None
    assert clip_range(QuantSpec.int8(narrow_range=True), T.INT8) is None  # -128 one code apart: accepted
    assert clip_range(QuantSpec.int8(narrow_range=True), T.INT8, exact=True) == (-127, 127)
    assert clip_range(QuantSpec(bits=7), T.INT8) == (-64, 63)
    assert clip_range(QuantSpec(bits=4, signed=False, symmetric=False), T.INT8) == (0, 15)
    assert clip_range(QuantSpec(bits=8, quant_min=-100, quant_max=100), T.INT8) == (-100, 100)
    assert clip_range(QuantSpec.fp8_e4m3(), T.FLOAT8E4M3FN) is None
