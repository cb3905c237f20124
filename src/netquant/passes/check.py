"""Final check: every config is deployable (no INITIAL / PASSIVE_INIT left, params everywhere)."""

from __future__ import annotations

from dataclasses import dataclass

from netquant.core.tensor_config import check_deployable
from netquant.passes.pipeline import PassContext


@dataclass
class DeployabilityCheck:
    name: str = "deployability check"

    def run(self, ctx: PassContext) -> None:
        check_deployable(ctx.qgraph.configs())
