"""Conv + BatchNorm pairs kept together for QAT (torch.ao's ConvBn approach).

Float ``ConvBn{1,2,3}d`` is exactly ``bn(conv(x))``.  ``QuantConvBn{1,2,3}d`` quantizes the folded
weight W' = W * g / sqrt(v + eps):
  training (BN not frozen):  y = bn(conv(Qin(x), Qw(W')) / f + b_conv)   (batch statistics, running
                             stats keep updating; f = g / sqrt(v + eps) from the running variance)
  eval / frozen BN:          y = conv(Qin(x), Qw(W'), (b_conv - m) * f + beta)
so the eval graph is the folded conv an inference engine runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from netquant.nn.modules.base import QuantModule
from netquant.nn.rules import LayerQuantConfig


class _ConvBnNd(nn.Module):
    conv_type: type[nn.Module]
    bn_type: type[nn.Module]

    def __init__(self, conv: nn.Module, bn: nn.Module) -> None:
        super().__init__()
        if not isinstance(conv, self.conv_type) or not isinstance(bn, self.bn_type):
            raise TypeError(f"{type(self).__name__} needs {self.conv_type.__name__} + {self.bn_type.__name__}, "
                            f"got {type(conv).__name__} + {type(bn).__name__}")
        self.conv = conv
        self.bn = bn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x))


class ConvBn1d(_ConvBnNd):
    conv_type, bn_type = nn.Conv1d, nn.BatchNorm1d


class ConvBn2d(_ConvBnNd):
    conv_type, bn_type = nn.Conv2d, nn.BatchNorm2d


class ConvBn3d(_ConvBnNd):
    conv_type, bn_type = nn.Conv3d, nn.BatchNorm3d


class _QuantConvBnNd(QuantModule):
    freeze_bn: bool = False

    def _factor(self) -> torch.Tensor:
        bn: Any = self.bn  # type: ignore[attr-defined]
        gamma = bn.weight if bn.weight is not None else torch.ones_like(bn.running_var)
        return gamma / torch.sqrt(bn.running_var + bn.eps)

    def _channel_view(self, t: torch.Tensor, ndim: int, axis: int) -> torch.Tensor:
        shape = [1] * ndim
        shape[axis] = -1
        return t.reshape(shape)

    @property
    def weight(self) -> torch.Tensor:
        """The BN-folded weight W * g / sqrt(v + eps) (what the weight quantizer sees)."""
        conv: Any = self.conv  # type: ignore[attr-defined]
        return conv.weight * self._channel_view(self._factor(), conv.weight.dim(), 0)

    def folded_bias(self) -> torch.Tensor:
        conv: Any = self.conv  # type: ignore[attr-defined]
        bn: Any = self.bn  # type: ignore[attr-defined]
        bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
        beta = bn.bias if bn.bias is not None else torch.zeros_like(bn.running_mean)
        return (bias - bn.running_mean) * self._factor() + beta

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        conv: Any = self.conv  # type: ignore[attr-defined]
        x = self.input_quantizer(input)
        w = self.weight_quantizer(self.weight)
        module: Any = self
        if module.training and not self.freeze_bn:
            y = conv._conv_forward(x, w, None) / self._channel_view(self._factor(), x.dim(), 1)
            if conv.bias is not None:
                y = y + self._channel_view(conv.bias, x.dim(), 1)
            y = module.bn(y)
        else:
            y = conv._conv_forward(x, w, self.folded_bias())
        return self.output_quantizer(y)


def _quant_class(float_type: type[_ConvBnNd]) -> type[nn.Module]:
    def __init__(self: Any, conv: nn.Module, bn: nn.Module, quant_config: LayerQuantConfig | None = None) -> None:
        float_type.__init__(self, conv, bn)
        self.init_quantizers(quant_config)

    name = "Quant" + float_type.__name__
    doc = f"QAT {float_type.__name__}: BN folded into the quantized weight (see module docstring)."
    return type(name, (_QuantConvBnNd, float_type), {"float_type": float_type, "__doc__": doc,
                                                     "__init__": __init__, "__module__": __name__})


QuantConvBn1d = _quant_class(ConvBn1d)
QuantConvBn2d = _quant_class(ConvBn2d)
QuantConvBn3d = _quant_class(ConvBn3d)

CONV_BN_TYPES: dict[type[nn.Module], type[_ConvBnNd]] = {nn.Conv1d: ConvBn1d, nn.Conv2d: ConvBn2d,
                                                          nn.Conv3d: ConvBn3d}
