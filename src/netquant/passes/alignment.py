"""Scale alignment after calibration: shared-scale groups get one set of params; derived configs settle.

A group (e.g. Concat's inputs and output on TensorRT / TFLite) gets the params that cover the
union of its members' ranges: range of a member = [(qmin - z) s, (qmax - z) s].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from netquant.core.qparams import choose_qparams
from netquant.core.spec import Granularity
from netquant.core.tensor_config import QuantState, TensorQuantConfig
from netquant.passes.base import Condition, PassBase, PassContext


def _range(cfg: TensorQuantConfig) -> tuple[torch.Tensor, torch.Tensor]:
    p = cfg.params
    assert p is not None
    if cfg.spec.is_float:
        amax = p.scale * cfg.spec.fp_max
        return -amax, amax
    z = p.zero_point.float()
    return (cfg.spec.qmin - z) * p.scale, (cfg.spec.qmax - z) * p.scale


def align_groups(groups: list[list[TensorQuantConfig]]) -> int:
    """Merge overlapping groups (by root) and give each one shared params; returns the group count."""
    parent: dict[int, TensorQuantConfig] = {}

    def find(c: TensorQuantConfig) -> TensorQuantConfig:
        while id(c) in parent and parent[id(c)] is not c:
            c = parent[id(c)]
        return c

    roots_by_id: dict[int, TensorQuantConfig] = {}
    for group in groups:
        roots = [m.root for m in group]
        for r in roots:
            roots_by_id[id(r)] = r
            parent.setdefault(id(r), r)
        first = find(roots[0])
        for r in roots[1:]:
            rr = find(r)
            if rr is not first:
                parent[id(rr)] = first
    clusters: dict[int, list[TensorQuantConfig]] = {}
    for r in roots_by_id.values():
        clusters.setdefault(id(find(r)), []).append(r)
    count = 0
    for members in clusters.values():
        members = [m for m in members if m.params is not None and m.spec.granularity is Granularity.PER_TENSOR]
        if len(members) < 2:
            continue
        lo = torch.stack([_range(m)[0] for m in members]).min()
        hi = torch.stack([_range(m)[1] for m in members]).max()
        master = members[0]
        master.params = choose_qparams(lo, hi, master.spec, name=master.name)
        for m in members[1:]:
            m.dominated_by = master
            m.params = None
        count += 1
    return count


@dataclass
class AlignmentPass(PassBase):
    """Gives each shared-scale group one set of params; activates configs that share a sibling's params."""

    name: ClassVar[str] = "scale alignment"
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.CALIBRATED})
    ensures: ClassVar[frozenset[Condition]] = frozenset({Condition.ALIGNED})

    def run(self, ctx: PassContext) -> None:
        qgraph = ctx.quantized
        qgraph.aligned_groups = align_groups(qgraph.shared_scale_groups)
        for cfg in qgraph.configs():
            if cfg.dominated_by is None:
                continue
            if cfg.state is QuantState.INITIAL:
                cfg.state = QuantState.ACTIVATED  # shares a sibling's / group's params
            elif cfg.state is QuantState.PASSIVE_INIT and cfg.effective_params is not None:
                cfg.state = QuantState.PASSIVE  # pass-through output: its input's params
