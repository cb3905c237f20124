"""Fake quantization with a CPU kernel's integer arithmetic: where onnxruntime runs an op as u8 x s8 int8
kernel (Conv, MatMul, Gemm with uint8 activations and int8 weights), the executor adds the kernel's
saturation term to the op's float output:

    y_kernel = y_exact + s_x * s_w[n] * sum_j (sat16(pair_j) - pair_j)       (core.int_kernels)

so the fake-quant run computes what a CPU without VNNI computes, and counts where pairs saturate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from netquant.core.int_kernels import (
    PAIR_LIMIT,
    Accumulation,
    LayoutKind,
    WeightLayout,
    conv_pairwise_correction,
    count_overflow_pairs,
    pairwise_correction,
)
from netquant.core.tensor_config import TensorQuantConfig
from netquant.graph import Node
from netquant.graph.op_config import TensorRole
from netquant.platforms.platform import weight_layout


@dataclass
class KernelSite:
    """One op onnxruntime runs as a u8 x s8 integer kernel."""

    node: Node
    act_index: int
    act_cfg: TensorQuantConfig
    weight_cfg: TensorQuantConfig
    weight_codes: torch.Tensor  # int8 codes, as exported
    kind: LayoutKind
    overflow_pairs: int  # weight pairs that can saturate in int16
    saturated_outputs: int = 0  # output elements a saturated pair sum changed, in the runs so far
    outputs: int = 0  # output elements computed in those runs
    weight_scale: torch.Tensor | None = None  # per-channel scale of weight_codes, if not the config's


def _codes(x: torch.Tensor, cfg: TensorQuantConfig) -> torch.Tensor:
    from netquant.passes.quant_graph import constant_codes

    return constant_codes(x, cfg)


def kernel_sites(qgraph: Any, overflowing_only: bool = False) -> list[KernelSite]:
    """The ops of `qgraph` that a u8 x s8 CPU kernel runs (uint8 activation and int8 weight both quantized);
    overflowing_only: just those with weight pairs that can saturate (weights pair-limited in the kernel's own
    layout are skipped without computing their codes: they cannot)."""
    from netquant.passes.quant_graph import emits

    sites = []
    for node in qgraph.graph.nodes:
        oc = qgraph.op_configs.get(node.name)
        if oc is None or node.op_type not in ("Conv", "MatMul", "Gemm"):
            continue
        a_idx, w_idx = oc.input_index(TensorRole.ACTIVATION), oc.input_index(TensorRole.WEIGHT)
        if a_idx is None or w_idx is None:
            continue
        a_cfg, w_cfg = oc.inputs[a_idx], oc.inputs[w_idx]
        if not (emits(a_cfg) or (a_cfg is not None and a_cfg.is_active)) or not emits(w_cfg):
            continue
        a_spec, w_spec = a_cfg.root.spec, w_cfg.root.spec
        if a_spec.is_float or w_spec.is_float or a_spec.signed or not w_spec.signed or \
                a_spec.bits != 8 or w_spec.bits != 8:
            continue
        weight = qgraph.graph.initializers.get(node.inputs[w_idx])
        layout = weight_layout(node, weight)
        if weight is None or layout is None:
            continue
        limit = w_cfg.effective_pair_limit
        if overflowing_only and limit is not None and limit.layout == layout and limit.limit <= PAIR_LIMIT:
            continue
        codes = _codes(weight.float(), w_cfg)
        site = KernelSite(node, a_idx, a_cfg, w_cfg, codes, layout.kind, count_overflow_pairs(codes, layout))
        if site.overflow_pairs or not overflowing_only:
            sites.append(site)
    return sites


def saturation_term(site: KernelSite, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(term to add to the op's float output, saturated pair sums) for activation input x (fake-quantized)."""
    params = site.act_cfg.effective_params
    assert params is not None
    s_x, z_x = params.scale.double(), params.zero_point.double()
    codes = torch.round(x.detach().double() / s_x + z_x).clamp(0, 255)
    if site.weight_scale is not None:
        s_w = site.weight_scale.double().reshape(-1)
    else:
        w_params = site.weight_cfg.effective_params
        assert w_params is not None
        s_w = w_params.scale.double().reshape(-1)
    node = site.node
    w = site.weight_codes
    if node.op_type == "Conv":
        from netquant.graph.ops.conv import resolve_pads

        nd = x.dim() - 2
        strides = [int(v) for v in node.attrs.get("strides", [1] * nd)]
        dil = [int(v) for v in node.attrs.get("dilations", [1] * nd)]
        kernel = [int(k) for k in node.attrs.get("kernel_shape", w.shape[2:])]
        pads = resolve_pads(node.attrs, list(x.shape[2:]), kernel, strides, dil, None)  # type: ignore[arg-type]
        corr = conv_pairwise_correction(codes, w, group=int(node.attrs.get("group", 1)), strides=strides,
                                        dilations=dil, pads=pads, pad_value=float(z_x.reshape(-1)[0]))
        scale = (s_x * s_w).reshape(1, -1, *([1] * nd))
    else:
        if node.op_type == "Gemm" and int(node.attrs.get("transA", 0)):
            codes = codes.t()
        corr = pairwise_correction(codes, WeightLayout(site.kind).to_nk(w))
        scale = s_x * (s_w if s_w.numel() > 1 else s_w.reshape(()))
        if node.op_type == "Gemm":
            scale = scale * float(node.attrs.get("alpha", 1.0))
    return (corr * scale).to(x.dtype), int((corr != 0).sum())


@dataclass
class SaturationEmulator:
    """Pre/post hooks that give a fake-quant executor the pairwise-int16 arithmetic of x86 without VNNI."""

    sites: dict[str, KernelSite]
    _inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @classmethod
    def for_graph(cls, qgraph: Any) -> SaturationEmulator:
        return cls({s.node.name: s for s in kernel_sites(qgraph, overflowing_only=True)})

    def capture(self, node: Node, inputs: list[Any]) -> None:
        site = self.sites.get(node.name)
        if site is not None:
            self._inputs[node.name] = inputs[site.act_index]

    def adjust(self, node: Node, outputs: list[Any]) -> list[Any]:
        site = self.sites.get(node.name)
        x = self._inputs.pop(node.name, None)
        if site is None or x is None:
            return outputs
        term, saturated = saturation_term(site, x)
        site.saturated_outputs += saturated
        site.outputs += term.numel()
        return [outputs[0] + term, *outputs[1:]]


def emulator_for(qgraph: Any, accumulation: Accumulation) -> SaturationEmulator | None:
    """The hooks' state for `accumulation` (None where the kernel is exact or no weight pair can saturate)."""
    if accumulation is Accumulation.EXACT:
        return None
    emu = SaturationEmulator.for_graph(qgraph)
    return emu if emu.sites else None

