"""Bias quantization: int32, zero point 0, scale = input scale x weight scale (PASSIVE)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from netquant.core.config import QuantState
from netquant.core.qparams import QParams
from netquant.passes.pipeline import PassContext
from netquant.passes.quant_graph import emits


@dataclass
class BiasPass:
    name: str = "bias quantization"

    def run(self, ctx: PassContext) -> None:
        qgraph = ctx.qgraph
        for oc in qgraph.op_configs.values():
            bias_idx = next((i for i, r in oc.roles.items() if r == "bias"), None)
            if bias_idx is None:
                continue
            b_cfg = oc.inputs[bias_idx]
            if b_cfg is None or b_cfg.state is not QuantState.PASSIVE_INIT:
                continue
            w_cfg = oc.weight_config()
            a_idx = next((i for i, r in oc.roles.items() if r == "activation"), None)
            a_cfg = oc.inputs[a_idx] if a_idx is not None else None
            a_params = a_cfg.effective_params if a_cfg is not None and a_cfg.is_active else None
            w_params = w_cfg.effective_params if w_cfg is not None and emits(w_cfg) else None
            if a_params is None or w_params is None:
                b_cfg.state = QuantState.FP32  # an unquantized input or weight: bias stays float
                continue
            scale = (a_params.scale.reshape(()) * w_params.scale).to(torch.float32)
            b_cfg.params = QParams(scale=scale, zero_point=torch.zeros(scale.shape, dtype=torch.int32))
            b_cfg.state = QuantState.PASSIVE
            bias = qgraph.graph.initializers.get(oc.op.inputs[bias_idx])
            if bias is not None:
                q = (bias.float().reshape(-1) / scale.reshape(-1)).abs().max()
                if q > b_cfg.spec.qmax:
                    warnings.warn(f"bias '{b_cfg.name}' of {oc.op.op_type} '{oc.op.name}' overflows int32 at "
                                  f"scale in*w (max |b/s| = {float(q):.3g}); it will be clipped", stacklevel=2)
