"""Graph clean-up before quantization: Constant nodes -> initializers, constant folding, BN folding,
exact simplifications (netquant.passes.simplify)."""

from __future__ import annotations

from dataclasses import dataclass

from netquant.passes.pipeline import PassContext


@dataclass
class CleanupPass:
    """Uses netquant.graph.edit; weights held in Constant nodes become initializers."""

    fold_constants: bool = True
    fold_batchnorm: bool = True
    simplify: bool = True
    name: str = "graph clean-up"

    def run(self, ctx: PassContext) -> None:
        from netquant.graph import edit

        graph = ctx.graph
        before = len(graph.nodes)
        edit.constants_to_initializers(graph)
        edit.remove_identity(graph)
        if self.fold_constants:
            edit.fold_constants(graph)
        if self.fold_batchnorm:
            edit.fold_batchnorm(graph)
        if self.simplify:
            from netquant.passes.simplify import simplify

            ctx.timings.update({f"simplified_{k}": v for k, v in simplify(graph).items()})
        graph.remove_unused()  # dead nodes would never be calibrated
        ctx.timings["nodes_before_cleanup"] = before
        ctx.timings["nodes_after_cleanup"] = len(graph.nodes)
