"""Quantized average pools: y = Qout(pool(Qin(x))).  No weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from netquant.nn.modules.base import QuantModule
from netquant.nn.rules import LayerQuantConfig


class _QuantPool(QuantModule):
    has_weight = False

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        pooled = self.float_type.forward(self, self.input_quantizer(input))  # type: ignore[arg-type]
        return self.output_quantizer(pooled)


def _pool_class(float_type: type[nn.Module]) -> type[nn.Module]:
    def __init__(self: Any, *args: Any, quant_config: LayerQuantConfig | None = None, **kwargs: Any) -> None:
        float_type.__init__(self, *args, **kwargs)
        self.init_quantizers(quant_config)

    name = "Quant" + float_type.__name__
    cls = type(name, (_QuantPool, float_type), {"float_type": float_type, "__init__": __init__,
                                                "__doc__": f"Drop-in {float_type.__name__} with input/output "
                                                           "quantizers.", "__module__": __name__})
    return cls


QuantAvgPool1d = _pool_class(nn.AvgPool1d)
QuantAvgPool2d = _pool_class(nn.AvgPool2d)
QuantAvgPool3d = _pool_class(nn.AvgPool3d)
QuantAdaptiveAvgPool1d = _pool_class(nn.AdaptiveAvgPool1d)
QuantAdaptiveAvgPool2d = _pool_class(nn.AdaptiveAvgPool2d)
QuantAdaptiveAvgPool3d = _pool_class(nn.AdaptiveAvgPool3d)
