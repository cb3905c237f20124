"""Quantization configs attached to one graph op: one per input and one per output."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from netquant.core.config import TensorQuantConfig
from netquant.graph.ir import Node


@dataclass
class OpQuantConfig:
    """Configs of one op: one per input and one per output (None = never quantized)."""

    op: Node
    inputs: list[TensorQuantConfig | None]
    outputs: list[TensorQuantConfig | None]
    # roles of the inputs the quantizer recognised (index -> "activation" | "weight" | "bias")
    roles: dict[int, str] = field(default_factory=dict)

    @property
    def is_quantized(self) -> bool:
        """True if any input or output is quantized (or waits for params)."""
        return any(c is not None and (c.is_active or c.state.is_pending)
                   for c in [*self.inputs, *self.outputs])

    def configs(self) -> Iterator[TensorQuantConfig]:
        yield from (c for c in [*self.inputs, *self.outputs] if c is not None)

    def weight_config(self) -> TensorQuantConfig | None:
        return next((self.inputs[i] for i, r in self.roles.items() if r == "weight"), None)

    def bias_config(self) -> TensorQuantConfig | None:
        return next((self.inputs[i] for i, r in self.roles.items() if r == "bias"), None)
