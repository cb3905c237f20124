"""The ONNX element type and opset a QuantSpec's QuantizeLinear / DequantizeLinear need.

One definition for both exporters (`netquant.export.qdq` for quantized graphs, `netquant.nn._qdq_op` for
modules): the integer range of each ONNX Q/DQ type, the opset that introduced it, and when a spec's range
is narrower than its type's in a way that needs a clamp.
"""

from __future__ import annotations

from collections.abc import Iterable

from onnx import TensorProto

from netquant.core.spec import Granularity, QuantFormat, QuantSpec

_T = TensorProto
# ONNX integer element type -> (min, max) it holds (QuantizeLinear saturates to it)
INT_RANGES: dict[int, tuple[int, int]] = {
    _T.INT4: (-8, 7), _T.UINT4: (0, 15), _T.INT8: (-128, 127), _T.UINT8: (0, 255),
    _T.INT16: (-32768, 32767), _T.UINT16: (0, 65535), _T.INT32: (-(2**31), 2**31 - 1),
}
FP8_TYPES: dict[QuantFormat, int] = {QuantFormat.FP8_E4M3: _T.FLOAT8E4M3FN, QuantFormat.FP8_E5M2: _T.FLOAT8E5M2}
# integer types QuantizeLinear produces, smallest first (what a module exporter may pick from)
QUANTIZE_TYPES: tuple[int, ...] = (_T.INT4, _T.UINT4, _T.INT8, _T.UINT8, _T.INT16, _T.UINT16)
_OPSET_21_TYPES = frozenset({_T.INT4, _T.UINT4, _T.INT16, _T.UINT16})


def qdq_min_opset(elem_type: int, spec: QuantSpec) -> int:
    """Lowest ai.onnx opset whose Q/DQ take `elem_type` with `spec`'s granularity (per-axis needs 13,
    FP8 19, int4/uint4/int16/uint16 and blocked per-group scales 21)."""
    need = 13
    if elem_type in FP8_TYPES.values():
        need = 19
    if elem_type in _OPSET_21_TYPES or spec.granularity is Granularity.PER_GROUP:
        need = 21
    return need


def smallest_int_type(spec: QuantSpec, opset: int, candidates: Iterable[int] = QUANTIZE_TYPES) -> int | None:
    """The first of `candidates` available at `opset` whose range holds [qmin, qmax]; None if none does."""
    for elem_type in candidates:
        lo, hi = INT_RANGES[elem_type]
        if qdq_min_opset(elem_type, spec) <= opset and lo <= spec.qmin and spec.qmax <= hi:
            return elem_type
    return None


def clip_range(spec: QuantSpec, elem_type: int, *, exact: bool = False) -> tuple[int, int] | None:
    """(qmin, qmax) when `spec`'s integer range is narrower than `elem_type`'s in a way that matters.

    None for FP8 and for an exact fit.  Unless `exact`, also None for a narrow range of the type's own width
    ([-127, 127] in int8: QuantizeLinear's one extra code, -128, is accepted, as engines do); `exact=True`
    (the module exporter, whose file must match the eager fake quantization) clamps it too.
    """
    if spec.is_float:
        return None
    lo, hi = INT_RANGES[elem_type]
    if (spec.qmin, spec.qmax) == (lo, hi):
        return None
    if not exact and spec.narrow_range and spec.quant_min is None and spec.bits == (hi - lo).bit_length():
        return None
    return spec.qmin, spec.qmax
