"""The ``netquant::qdq`` custom op: what a quantizer looks like while being exported to ONNX.

    y = DequantizeLinear(QuantizeLinear(Clip(x, lo, hi), s, z, axis, block_size), s, z, axis, block_size)

Eager semantics (ONNX): y = (clamp(round_half_even(x' / s) + z, qmin, qmax) - z) * s for integer
targets; y = cast_fp8(clamp(x' / s, -fmax, fmax)) * s for FP8 targets, with x' = clamp(x, lo, hi).
The Clip is there only when the spec's integer range is narrower than the ONNX type's (int8 narrow
[-127, 127], reduced-bit specs): lo = (qmin - z) * s, hi = (qmax - z) * s, passed as float
attributes (+-inf: no Clip) and emitted as Constant nodes inside the translation.  Keeping the clamp
inside the op, rather than as a torch.clamp on tensor constants before it, matters: torch.onnx names
lifted clamp bounds after their input and drops one of two identical bounds on the same tensor (an
Embedding output feeding two quantized layers), leaving a Clip that reads a missing initializer.
The ONNX translation is installed by ``netquant.nn.export`` through ``custom_translation_table``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from netquant.core.qdq_types import FP8_TYPES, INT_RANGES, clip_range, qdq_min_opset, smallest_int_type
from netquant.core.spec import FP8_DTYPE, FP8_MAX, Granularity, QuantSpec
from netquant.errors import ExportError

if TYPE_CHECKING:
    from netquant.nn.quantizer import TensorQuantizer

_FP8_FORMATS = {elem_type: fmt for fmt, elem_type in FP8_TYPES.items()}


def _broadcast(param: torch.Tensor, x: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    if param.dim() == 0:
        return param
    if block_size > 0:
        param = param.repeat_interleave(block_size, dim=axis).narrow(axis, 0, x.shape[axis])
        return param
    shape = [1] * x.dim()
    shape[axis] = -1
    return param.reshape(shape)


@torch.library.custom_op("netquant::qdq", mutates_args=())
def qdq(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, block_size: int,
        onnx_type: int, clip_lo: float, clip_hi: float) -> torch.Tensor:
    """Clip, then ONNX QuantizeLinear followed by DequantizeLinear (see module docstring)."""
    if clip_lo > -math.inf or clip_hi < math.inf:
        x = torch.clamp(x, clip_lo, clip_hi)
    s = _broadcast(scale.float(), x, axis, block_size)
    if onnx_type in _FP8_FORMATS:
        fmt = _FP8_FORMATS[onnx_type]
        return (x / s).clamp(-FP8_MAX[fmt], FP8_MAX[fmt]).to(FP8_DTYPE[fmt]).float() * s
    qmin, qmax = INT_RANGES[onnx_type]
    z = _broadcast(zero_point.float(), x, axis, block_size)
    return (torch.clamp(torch.round(x / s) + z, qmin, qmax) - z) * s


@qdq.register_fake
def _qdq_fake(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, block_size: int,
              onnx_type: int, clip_lo: float, clip_hi: float) -> torch.Tensor:
    return torch.empty_like(x)


def onnx_target(spec: QuantSpec, opset: int, where: str) -> tuple[int, bool]:
    """(ONNX element type of the Q output, whether [qmin, qmax] needs an extra clamp); see
    netquant.core.qdq_types."""
    if spec.is_float:
        onnx_type = FP8_TYPES[spec.fmt]
        if opset < qdq_min_opset(onnx_type, spec):
            raise ExportError(f"{where}: FP8 Q/DQ needs opset >= 19, asked for {opset}")
        return onnx_type, False
    if spec.granularity is Granularity.PER_GROUP and opset < 21:
        raise ExportError(f"{where}: per-group (blocked) Q/DQ needs opset >= 21, asked for {opset}")
    onnx_type = smallest_int_type(spec, opset)
    if onnx_type is None:
        raise ExportError(f"{where}: integer range [{spec.qmin}, {spec.qmax}] ({spec.describe()}) has no ONNX Q/DQ "
                          f"type at opset {opset}; use opset >= 21 or at most 8 bits")
    return onnx_type, clip_range(spec, onnx_type, exact=True) is not None


@dataclass
class ExportPlan:
    """Everything a quantizer needs while traced for export, fixed beforehand (no buffer reads)."""

    scale: torch.Tensor
    zero_point: torch.Tensor
    axis: int
    block_size: int
    onnx_type: int
    clamp: tuple[float, float] | None  # float bounds (lo, hi) of an activation narrower than its ONNX type
    weight: torch.Tensor | None  # weights: the already fake-quantized tensor, fed to Q/DQ as-is


def make_export_plan(quantizer: TensorQuantizer, opset: int, ndim: int | None,
                     weight: torch.Tensor | None = None) -> ExportPlan:
    """The plan for one calibrated quantizer (``ndim``: rank of the tensor it sees, if known)."""
    spec = quantizer.spec
    assert spec is not None
    where = f"quantizer '{quantizer.name}'"
    if quantizer.dynamic:
        raise ExportError(f"{where} quantizes dynamically (per batch); QDQ export needs static params")
    if not quantizer.is_calibrated:
        raise ExportError(f"{where} is not calibrated")
    onnx_type, needs_clamp = onnx_target(spec, opset, where)
    params = quantizer.params
    axis = spec.axis if spec.axis is not None else 1
    if axis < 0:
        if ndim is None:
            raise ExportError(f"{where}: negative axis {axis} needs a known tensor rank at export")
        axis += ndim
    block = spec.group_size if spec.granularity is Granularity.PER_GROUP and spec.group_size else 0
    clamp = None
    if needs_clamp and weight is None:
        if spec.granularity is not Granularity.PER_TENSOR:
            raise ExportError(f"{where}: a {spec.bits}-bit per-channel/per-group activation range needs an "
                              "exact ONNX Q/DQ type; use opset >= 21 or 8/16/4-bit specs")
        z = params.zero_point.float()
        lo, hi = (spec.qmin - z) * params.scale, (spec.qmax - z) * params.scale  # float32, exact as floats
        clamp = (float(lo), float(hi))
    return ExportPlan(params.scale.clone(), params.zero_point.clone(), axis, block, onnx_type, clamp,
                      None if weight is None else weight.detach().clone())


def export_qdq(quantizer: TensorQuantizer, x: torch.Tensor) -> torch.Tensor:
    """Forward of ``quantizer`` while exporting: an (optional clamp and) netquant::qdq call."""
    plan: ExportPlan | None = getattr(quantizer, "_export_plan", None)
    if plan is None:
        raise ExportError(f"quantizer '{quantizer.name}' was reached during export without an export plan")
    if plan.weight is not None:
        x = plan.weight
    lo, hi = plan.clamp if plan.clamp is not None else (-math.inf, math.inf)
    return torch.ops.netquant.qdq(x, plan.scale, plan.zero_point, plan.axis, plan.block_size, plan.onnx_type,
                                  lo, hi)
