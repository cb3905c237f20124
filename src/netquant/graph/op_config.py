"""Quantization configs attached to one graph op: one per input and one per output."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from netquant.core.tensor_config import TensorQuantConfig
from netquant.graph.ir import Node


class TensorRole(enum.StrEnum):
    """What an op input is to the quantizer."""

    ACTIVATION = "activation"
    WEIGHT = "weight"
    BIAS = "bias"


@dataclass
class OpQuantConfig:
    """Configs of one op: one per input and one per output (None = never quantized)."""

    op: Node
    inputs: list[TensorQuantConfig | None]
    outputs: list[TensorQuantConfig | None]
    # roles of the inputs the quantizer recognised (input index -> role)
    roles: dict[int, TensorRole] = field(default_factory=dict)

    @property
    def is_quantized(self) -> bool:
        """True if any input or output is quantized (or waits for params)."""
        return any(c is not None and (c.is_active or c.state.is_pending)
                   for c in [*self.inputs, *self.outputs])

    def configs(self) -> Iterator[TensorQuantConfig]:
        yield from (c for c in [*self.inputs, *self.outputs] if c is not None)

    def weight_config(self) -> TensorQuantConfig | None:
        i = self.input_index(TensorRole.WEIGHT)
        return None if i is None else self.inputs[i]

    def bias_config(self) -> TensorQuantConfig | None:
        i = self.input_index(TensorRole.BIAS)
        return None if i is None else self.inputs[i]

    def input_index(self, role: TensorRole) -> int | None:
        """Index of the first input with this role, or None."""
        return next((i for i, r in self.roles.items() if r == role), None)
