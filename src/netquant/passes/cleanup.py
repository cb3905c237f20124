"""Graph clean-up before quantization: Constant nodes -> initializers, constant folding, BN folding,
exact simplifications (netquant.passes.simplify)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from netquant.passes.base import Condition, PassBase, PassContext
from netquant.passes.quant_graph import CleanupCounts


@dataclass
class CleanupPass(PassBase):
    """Uses netquant.graph.edit; weights held in Constant nodes become initializers; records ctx.cleanup."""

    fold_constants: bool = True
    fold_batchnorm: bool = True
    simplify: bool = True
    name: ClassVar[str] = "graph clean-up"
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.GRAPH})
    ensures: ClassVar[frozenset[Condition]] = frozenset({Condition.GRAPH})

    def run(self, ctx: PassContext) -> None:
        from netquant.graph import edit

        graph = ctx.graph
        before = len(graph.nodes)
        edit.constants_to_initializers(graph)
        edit.remove_identity(graph)
        if self.fold_constants:
            from netquant.passes.embeddings import embeddings_wanted, table_gather

            edit.fold_constants(graph, keep=table_gather if embeddings_wanted(ctx.settings) else None)
        if self.fold_batchnorm:
            edit.fold_batchnorm(graph)
        simplified: dict[str, int] = {}
        if self.simplify:
            from netquant.passes.simplify import simplify

            simplified = dict(simplify(graph))
        graph.remove_unused()  # dead nodes would never be calibrated
        ctx.cleanup = CleanupCounts(nodes_before=before, nodes_after=len(graph.nodes), simplified=simplified)
