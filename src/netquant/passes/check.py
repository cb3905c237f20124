"""Final check: every config is deployable (no INITIAL / PASSIVE_INIT left, params everywhere)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from netquant.core.tensor_config import check_deployable
from netquant.passes.base import Condition, PassBase, PassContext


@dataclass
class DeployabilityCheck(PassBase):
    """Raises (netquant.core.tensor_config.check_deployable) if any config still lacks its params."""

    name: ClassVar[str] = "deployability check"
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.CONFIGS})
    ensures: ClassVar[frozenset[Condition]] = frozenset({Condition.DEPLOYABLE})

    def run(self, ctx: PassContext) -> None:
        check_deployable(ctx.quantized.configs())
