"""Functional quantization sites for ops that are not modules in torch: add, matmul, cat.

Put them in a model where the op should be quantized (``self.add = QuantAdd()``); they are exact
pass-throughs until ``quantize_model`` gives them quantizers.  The ``input`` config of a rule is
applied to every operand; ``QuantCat`` shares one input quantizer (one scale) across its inputs,
as concat in an integer engine requires.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from netquant.nn.modules.base import QuantModule, make_quantizer
from netquant.nn.quantizer import QuantizerRole
from netquant.nn.rules import LayerQuantConfig


class _FunctionalSite(nn.Module, QuantModule):
    has_weight = False

    def __init__(self, quant_config: LayerQuantConfig | None = None) -> None:
        super().__init__()
        self.init_quantizers(quant_config)


class QuantAdd(_FunctionalSite):
    """y = Qout(Qa(a) + Qb(b))."""

    def init_quantizers(self, layer: LayerQuantConfig | None) -> None:
        super().init_quantizers(layer)
        self.other_quantizer = make_quantizer((layer or LayerQuantConfig()).input, QuantizerRole.ACTIVATION)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.output_quantizer(self.input_quantizer(a) + self.other_quantizer(b))


class QuantMatmul(_FunctionalSite):
    """y = Qout(matmul(Qa(a), Qb(b)))."""

    def init_quantizers(self, layer: LayerQuantConfig | None) -> None:
        super().init_quantizers(layer)
        self.other_quantizer = make_quantizer((layer or LayerQuantConfig()).input, QuantizerRole.ACTIVATION)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.output_quantizer(torch.matmul(self.input_quantizer(a), self.other_quantizer(b)))


class QuantCat(_FunctionalSite):
    """y = Qout(cat([Q(x) for x in xs], dim)) with one shared input quantizer."""

    def __init__(self, dim: int = 0, quant_config: LayerQuantConfig | None = None) -> None:
        self.dim = dim
        super().__init__(quant_config)

    def forward(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        return self.output_quantizer(torch.cat([self.input_quantizer(t) for t in tensors], dim=self.dim))

    def extra_repr(self) -> str:
        return f"dim={self.dim}"
