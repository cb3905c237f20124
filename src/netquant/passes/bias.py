"""Bias quantization: int32, zero point 0, scale = input scale x weight scale (PASSIVE).

Integer kernels (QLinearConv, QGemm, TFLite, ...) add the int32 bias to the int32 accumulator
sum_k (x_q - z_x) * w_q, so the bias scale must stay s_b = s_in * s_w[c]. A bias too large for
that scale (|b[c]| / (s_in * s_w[c]) > limit; typical after BatchNorm folding when a channel's
weights are ~0) would be clipped, silently changing the model. Instead the weight scale of each
such channel is enlarged (per-tensor weights: the single scale):

    s_w'[c] = max(s_w[c], |b[c]| / (s_in * limit))     (power-of-two specs: rounded up to 2^k)
    limit   = max(b_qmax - fan_in * span_x * max|w_q|, b_qmax / 2)

`limit` leaves room in int32 for the worst-case accumulation of one output. The weights are
quantized with the new scale wherever their params are used (fake quantization, export).
Only when that cannot work (degenerate input scale, non-finite bias, baked weights) is the
bias clipped, with a warning.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import ClassVar

import torch

from netquant.core.qparams import TINY, QParams, pow2_ceil
from netquant.core.spec import QuantSpec, ScaleConstraint
from netquant.core.tensor_config import QuantState, TensorQuantConfig
from netquant.graph.op_config import OpQuantConfig, TensorRole
from netquant.passes.base import Condition, PassBase, PassContext
from netquant.passes.quant_graph import emits
from netquant.passes.quantizer import GraphIndex


class BiasOverflowWarning(UserWarning):
    """A bias does not fit int32 at scale s_in * s_w: its weight scale was enlarged (or, failing that, it is clipped)."""


@dataclass(frozen=True)
class BiasScaleAdjustment:
    """One op whose weight scale was enlarged so its int32 bias fits."""

    op: str
    op_type: str
    bias: str
    weight: str
    channels: int  # output channels whose weight scale grew
    total_channels: int
    max_ratio: float  # max |b / (s_in * s_w)| before the adjustment
    limit: float  # largest |b_q| allowed
    per_tensor: bool = False  # one weight scale for all channels (enlarged to the largest need)

    def message(self) -> str:
        what = (f"the per-tensor weight scale of '{self.weight}' to max |b| / (s_in * {self.limit:.0f})"
                if self.per_tensor else
                f"the weight scale of '{self.weight}' in those channels to |b| / (s_in * {self.limit:.0f})")
        return (f"bias '{self.bias}' of {self.op_type} '{self.op}' overflows int32 at scale in*w in "
                f"{self.channels} of {self.total_channels} output channel(s) (max |b/s| = {self.max_ratio:.3g}); "
                f"enlarged {what} so the bias fits without clipping")


def _max_abs_level(spec: QuantSpec) -> int:
    """Largest |q - z| a value of `spec` can take (affine: the whole span)."""
    if spec.symmetric:
        return max(-spec.qmin, spec.qmax)
    return spec.qmax - spec.qmin


def bias_limit(bias_spec: QuantSpec, act_spec: QuantSpec, weight_spec: QuantSpec, fan_in: int) -> float:
    """Largest |b_q| that leaves int32 room for one output's accumulation:
    max(b_qmax - fan_in * max|x_q - z_x| * max|w_q - z_w|, b_qmax / 2)."""
    qmax = float(bias_spec.qmax)
    if act_spec.is_float or weight_spec.is_float:
        return math.floor(qmax / 2)
    acc = float(fan_in) * _max_abs_level(act_spec) * _max_abs_level(weight_spec)
    return max(qmax - acc, math.floor(qmax / 2))


def enlarged_weight_scale(bias: torch.Tensor, s_in: float, s_w: torch.Tensor, limit: float,
                          spec: QuantSpec) -> torch.Tensor:
    """s_w' = max(s_w, |b| / (s_in * limit)) per channel (a per-tensor s_w: the max over all channels).

    Power-of-two specs round s_w' up to a power of two. Computed in float64, returned in s_w's dtype.
    """
    need = bias.detach().double().reshape(-1).abs() / (float(s_in) * float(limit))
    old = s_w.detach().double()
    if old.numel() == 1:
        need = need.max().reshape(old.shape)
    else:
        need = need.reshape(old.shape)
    new = torch.maximum(old, need)
    if spec.scale_constraint is ScaleConstraint.POWER_OF_TWO:
        new = torch.where(new > old, pow2_ceil(new), old)
    new32 = new.to(s_w.dtype)
    # float32 rounding may land just below the required value: step up one ulp there
    low = (new32.double() < need) & (new > old)
    return torch.where(low, torch.nextafter(new32, torch.full_like(new32, math.inf)), new32)


def _bias_ratio(bias: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """|b / s| per output channel (s broadcast to b's length)."""
    b = bias.detach().double().reshape(-1)
    return (b / scale.detach().double().reshape(-1).expand_as(b)).abs()


@dataclass
class BiasPass(PassBase):
    """Derive every PASSIVE_INIT bias config's params; enlarge weight scales where a bias would overflow."""

    name: ClassVar[str] = "bias quantization"
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.ALIGNED})
    ensures: ClassVar[frozenset[Condition]] = frozenset({Condition.BIASES})

    def run(self, ctx: PassContext) -> None:
        qgraph = ctx.quantized
        index = GraphIndex(qgraph.graph)
        pending: list[tuple[OpQuantConfig, TensorQuantConfig, TensorQuantConfig, TensorQuantConfig]] = []
        for oc in qgraph.op_configs.values():
            bias_idx = oc.input_index(TensorRole.BIAS)
            if bias_idx is None:
                continue
            b_cfg = oc.inputs[bias_idx]
            if b_cfg is None or b_cfg.state is not QuantState.PASSIVE_INIT:
                continue
            w_cfg = oc.weight_config()
            a_idx = oc.input_index(TensorRole.ACTIVATION)
            a_cfg = oc.inputs[a_idx] if a_idx is not None else None
            if a_cfg is None or not a_cfg.is_active or a_cfg.effective_params is None or not emits(w_cfg):
                b_cfg.state = QuantState.FP32  # an unquantized input or weight: bias stays float
                continue
            assert w_cfg is not None
            pending.append((oc, a_cfg, w_cfg, b_cfg))

        # 1. enlarge weight scales first (a weight config may be shared: scales only ever grow)
        adjustments: list[BiasScaleAdjustment] = []
        for oc, a_cfg, w_cfg, b_cfg in pending:
            adj = self._fit(oc, index, a_cfg, w_cfg, b_cfg)
            if adj is not None:
                adjustments.append(adj)
                msg = adj.message()
                qgraph.warnings.append(msg)
                warnings.warn(msg, BiasOverflowWarning, stacklevel=2)
        qgraph.bias_scale_adjustments = adjustments

        # 2. bias params from the final scales
        for oc, a_cfg, w_cfg, b_cfg in pending:
            a_params, w_params = a_cfg.effective_params, w_cfg.effective_params
            assert a_params is not None and w_params is not None
            scale = (a_params.scale.reshape(()) * w_params.scale).to(torch.float32)
            underflow = (scale < TINY) & (a_params.scale.reshape(()) > 0) & (w_params.scale > 0)
            if bool(underflow.any()):  # s_in, s_w > 0 but s_in * s_w below float32's normal range
                msg = (f"bias '{b_cfg.name}' of {oc.op.op_type} '{oc.op.name}' stays float: its int32 scale "
                       f"s_in * s_w = {float(scale[underflow].min()):.3g} is below float32's normal range (tensors of "
                       "magnitude ~1e-20 or smaller)")
                qgraph.warnings.append(msg)
                warnings.warn(msg, BiasOverflowWarning, stacklevel=2)
                b_cfg.state = QuantState.FP32
                continue
            b_cfg.params = QParams(scale=scale, zero_point=torch.zeros(scale.shape, dtype=torch.int32))
            b_cfg.state = QuantState.PASSIVE
            bias = index.constant(oc.op.inputs[oc.inputs.index(b_cfg)])
            if bias is None:
                continue
            q = float(_bias_ratio(bias, scale).max()) if bias.numel() else 0.0
            if q > b_cfg.spec.qmax:
                msg = (f"bias '{b_cfg.name}' of {oc.op.op_type} '{oc.op.name}' overflows int32 at scale in*w "
                       f"(max |b/s| = {q:.3g}) and the weight scale could not be enlarged "
                       f"({self._why_not(a_cfg, w_cfg, bias)}); it will be clipped")
                qgraph.warnings.append(msg)
                warnings.warn(msg, BiasOverflowWarning, stacklevel=2)

    @staticmethod
    def _why_not(a_cfg: TensorQuantConfig, w_cfg: TensorQuantConfig, bias: torch.Tensor) -> str:
        s_in = float(a_cfg.effective_params.scale.reshape(-1)[0]) if a_cfg.effective_params is not None else 0.0
        if not (math.isfinite(s_in) and s_in > 0):
            return f"input scale is {s_in:g}"
        if not bool(torch.isfinite(bias).all()):
            return "the bias is not finite"
        if w_cfg.root.state is QuantState.BAKED:
            return "the weights are baked"
        return "the weight and bias scales do not match channel for channel"

    def _fit(self, oc: OpQuantConfig, index: GraphIndex, a_cfg: TensorQuantConfig, w_cfg: TensorQuantConfig,
             b_cfg: TensorQuantConfig) -> BiasScaleAdjustment | None:
        """Enlarge the weight scale of the channels whose bias overflows; None if nothing changed."""
        b_name = oc.op.inputs[oc.inputs.index(b_cfg)]
        w_name = oc.op.inputs[oc.inputs.index(w_cfg)]
        bias, weight = index.constant(b_name), index.constant(w_name)
        w_root = w_cfg.root
        a_params, w_params = a_cfg.effective_params, w_root.params
        if bias is None or weight is None or bias.numel() == 0 or a_params is None or w_params is None:
            return None
        if a_params.scale.numel() != 1 or w_params.scale.numel() not in (1, bias.numel()):
            return None  # no channel-for-channel correspondence (e.g. per-group weights): check will warn
        s_in = float(a_params.scale.reshape(()))
        if not (math.isfinite(s_in) and s_in > 0) or not bool(torch.isfinite(bias).all()):
            return None
        if w_root.state is QuantState.BAKED:
            return None  # the stored weights are already integers at this scale
        ratio = _bias_ratio(bias, s_in * w_params.scale.double())
        fan_in = max(weight.numel() // bias.numel(), 1)
        limit = bias_limit(b_cfg.spec, a_cfg.root.spec, w_root.spec, fan_in)
        over = ratio > limit
        if not bool(over.any()):
            return None
        new_scale = enlarged_weight_scale(bias, s_in, w_params.scale, limit, w_root.spec)
        w_root.params = QParams(scale=new_scale, zero_point=w_params.zero_point)
        return BiasScaleAdjustment(op=oc.op.name, op_type=oc.op.op_type, bias=b_cfg.name, weight=w_root.name,
                                   channels=int(over.sum()), total_channels=bias.numel(),
                                   max_ratio=float(ratio.max()), limit=limit,
                                   per_tensor=w_params.scale.numel() == 1 and bias.numel() > 1)
