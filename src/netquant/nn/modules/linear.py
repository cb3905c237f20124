"""QuantLinear: y = linear(Qin(x), Qw(W), b), then Qout."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from netquant.nn.modules.base import QuantModule
from netquant.nn.rules import LayerQuantConfig


class QuantLinear(nn.Linear, QuantModule):
    """Drop-in nn.Linear with input, weight (per-channel axis 0) and output quantizers."""

    float_type = nn.Linear

    def __init__(self, *args: Any, quant_config: LayerQuantConfig | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.init_quantizers(quant_config)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        y = F.linear(self.input_quantizer(input), self.weight_quantizer(self.weight), self.bias)
        return self.output_quantizer(y)
