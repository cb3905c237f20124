"""Build a config for every input / output of every op from the platform rules and the user overrides."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from netquant.passes.base import Condition, PassBase, PassContext
from netquant.passes.overrides import resolve_overrides
from netquant.passes.quantizer import build_quant_graph


@dataclass
class BuildConfigsPass(PassBase):
    """Sets ctx.qgraph (netquant.passes.quantizer) for the settings' effective platform."""

    name: ClassVar[str] = "quantization configs"
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.GRAPH})
    ensures: ClassVar[frozenset[Condition]] = frozenset({Condition.CONFIGS})

    def run(self, ctx: PassContext) -> None:
        s = ctx.settings
        overrides = resolve_overrides(ctx.graph, s.force_fp32, s.overrides)
        ctx.qgraph = build_quant_graph(ctx.graph, s.effective_platform(), overrides, strict=s.strict)
