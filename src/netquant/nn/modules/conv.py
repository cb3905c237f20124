"""Quantized convolutions: y = conv(Qin(x), Qw(W), b), then Qout.

Weights are quantized per output channel: axis 0 for Conv, axis 1 for ConvTranspose
(whose weight is laid out [C_in, C_out / groups, *k]).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from netquant.nn.modules.base import QuantModule
from netquant.nn.rules import LayerQuantConfig


class _QuantConvNd(QuantModule):
    def forward(self, input: torch.Tensor) -> torch.Tensor:
        conv: Any = self
        y = conv._conv_forward(self.input_quantizer(input), self.weight_quantizer(conv.weight), conv.bias)
        return self.output_quantizer(y)


class QuantConv1d(_QuantConvNd, nn.Conv1d):
    float_type = nn.Conv1d

    def __init__(self, *args: Any, quant_config: LayerQuantConfig | None = None, **kwargs: Any) -> None:
        nn.Conv1d.__init__(self, *args, **kwargs)
        self.init_quantizers(quant_config)


class QuantConv2d(_QuantConvNd, nn.Conv2d):
    float_type = nn.Conv2d

    def __init__(self, *args: Any, quant_config: LayerQuantConfig | None = None, **kwargs: Any) -> None:
        nn.Conv2d.__init__(self, *args, **kwargs)
        self.init_quantizers(quant_config)


class QuantConv3d(_QuantConvNd, nn.Conv3d):
    float_type = nn.Conv3d

    def __init__(self, *args: Any, quant_config: LayerQuantConfig | None = None, **kwargs: Any) -> None:
        nn.Conv3d.__init__(self, *args, **kwargs)
        self.init_quantizers(quant_config)


_TRANSPOSED_FN = {1: F.conv_transpose1d, 2: F.conv_transpose2d, 3: F.conv_transpose3d}


class _QuantConvTransposeNd(QuantModule):
    weight_out_axis = 1
    weight_in_axis = 0
    spatial_dims: int

    def forward(self, input: torch.Tensor, output_size: list[int] | None = None) -> torch.Tensor:
        conv: Any = self
        if conv.padding_mode != "zeros":
            raise ValueError(f"Only `zeros` padding mode is supported for {type(self).__name__}")
        output_padding = conv._output_padding(input, output_size, conv.stride, conv.padding, conv.kernel_size,
                                              self.spatial_dims, conv.dilation)
        y = _TRANSPOSED_FN[self.spatial_dims](self.input_quantizer(input), self.weight_quantizer(conv.weight),
                                              conv.bias, conv.stride, conv.padding, output_padding, conv.groups,
                                              conv.dilation)
        return self.output_quantizer(y)


class QuantConvTranspose1d(_QuantConvTransposeNd, nn.ConvTranspose1d):
    float_type = nn.ConvTranspose1d
    spatial_dims = 1

    def __init__(self, *args: Any, quant_config: LayerQuantConfig | None = None, **kwargs: Any) -> None:
        nn.ConvTranspose1d.__init__(self, *args, **kwargs)
        self.init_quantizers(quant_config)


class QuantConvTranspose2d(_QuantConvTransposeNd, nn.ConvTranspose2d):
    float_type = nn.ConvTranspose2d
    spatial_dims = 2

    def __init__(self, *args: Any, quant_config: LayerQuantConfig | None = None, **kwargs: Any) -> None:
        nn.ConvTranspose2d.__init__(self, *args, **kwargs)
        self.init_quantizers(quant_config)


class QuantConvTranspose3d(_QuantConvTransposeNd, nn.ConvTranspose3d):
    float_type = nn.ConvTranspose3d
    spatial_dims = 3

    def __init__(self, *args: Any, quant_config: LayerQuantConfig | None = None, **kwargs: Any) -> None:
        nn.ConvTranspose3d.__init__(self, *args, **kwargs)
        self.init_quantizers(quant_config)
