"""Where int8 weights would saturate the int16 pair sums of x86 CPUs without VNNI, op by op.

For every op onnxruntime runs as a u8 x s8 kernel, on the model's own activations (fake-quantized):
- the weight pairs that can overflow with full-range int8 weights (scale amax / 127.5 per channel) and with the
  weights this model really has;
- the share of output elements a saturated pair sum changes, and the signal-to-saturation ratio
  10 log10(sum y^2 / sum e^2) with e = s_x * s_w * sum_j (sat16(pair_j) - pair_j), for full-range int8 weights.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from netquant.core.int_kernels import WeightLayout, count_overflow_pairs
from netquant.errors import DataError
from netquant.passes.int_emulation import KernelSite, kernel_sites, saturation_term


@dataclass(frozen=True)
class SaturationRow:
    """One int8-kernel op: overflow-prone weight pairs and what full-range int8 weights do to its output."""

    op: str
    op_type: str
    pairs: int  # weight pairs in the kernel's K order
    full_int8_overflow_pairs: int
    overflow_pairs: int  # with this model's weights (0: safe on every CPU)
    saturated_outputs: float  # share of output elements changed, full-range int8 weights
    signal_to_saturation_db: float  # inf: no saturation

    def row(self) -> list[str]:
        return [self.op, self.op_type, f"{self.full_int8_overflow_pairs}/{self.pairs}", str(self.overflow_pairs),
                f"{100 * self.saturated_outputs:.2f}", f"{self.signal_to_saturation_db:.1f}"]


HEADER = ["op", "type", "overflow pairs, full int8", "overflow pairs, this model", "saturated outputs %",
          "signal/saturation dB"]


def _full_range_site(site: KernelSite, weight: torch.Tensor) -> KernelSite:
    """The same op with full-range int8 per-channel weights (what --target x86-vnni exports)."""
    out_axis = 0 if site.kind.value in ("conv_nhwc", "cols") else weight.dim() - 1
    dims = [d for d in range(weight.dim()) if d != out_axis]
    scale = (weight.abs().amax(dims) / 127.5).clamp_min(1e-12)
    shape = [-1 if d == out_axis else 1 for d in range(weight.dim())]
    codes = torch.round(weight / scale.reshape(shape)).clamp(-128, 127).to(torch.int8)
    layout = WeightLayout(site.kind)
    return KernelSite(site.node, site.act_index, site.act_cfg, site.weight_cfg, codes, site.kind,
                      count_overflow_pairs(codes, layout), weight_scale=scale)


def saturation_report(qgraph: Any, batches: Iterable[Any]) -> list[SaturationRow]:
    """SaturationRow per int8-kernel op over `batches` of model inputs."""
    sites = kernel_sites(qgraph)
    full = {s.node.name: _full_range_site(s, qgraph.graph.initializers[s.node.inputs[1]].float()) for s in sites}
    now = {s.node.name: s.overflow_pairs for s in sites}
    sums = {name: [0.0, 0.0, 0, 0] for name in full}  # signal, saturation energy, changed, elements
    captured: dict[str, torch.Tensor] = {}
    ex = qgraph.executor(fake_quant=True)

    def pre(node: Any, inputs: list[Any]) -> None:
        site = full.get(node.name)
        if site is not None:
            captured[node.name] = inputs[site.act_index]

    def post(node: Any, outputs: list[Any]) -> None:
        site = full.get(node.name)
        x = captured.pop(node.name, None)
        if site is None or x is None:
            return
        s = sums[node.name]
        y = outputs[0].double()
        s[0] += float((y ** 2).sum())
        s[3] += y.numel()
        if site.overflow_pairs:
            term, changed = saturation_term(site, x)
            s[1] += float((term.double() ** 2).sum())
            s[2] += changed

    # hooks run after the fake-quant hooks: inputs as the int8 kernel sees them
    ex.add_pre_hook(pre)
    ex.add_post_hook(post)
    seen = 0
    with torch.no_grad():
        for batch in batches:
            ex.run(batch)
            seen += 1
    if seen == 0:
        raise DataError("saturation_report needs at least one batch of inputs")
    rows = []
    for site in sites:
        s = sums[site.node.name]
        n, k = WeightLayout(site.kind).to_nk(site.weight_codes).shape
        pairs = n * ((k + 1) // 2)
        ratio = math.inf if s[1] == 0 else 10 * math.log10(max(s[0], 1e-300) / s[1])
        rows.append(SaturationRow(site.node.name, site.node.op_type, pairs, full[site.node.name].overflow_pairs,
                                  now[site.node.name], s[2] / max(1, s[3]), ratio))
    return rows
