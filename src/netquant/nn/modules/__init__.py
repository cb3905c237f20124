"""Quantized drop-in modules."""

from netquant.nn.modules.base import QuantModule
from netquant.nn.modules.conv import (
    QuantConv1d,
    QuantConv2d,
    QuantConv3d,
    QuantConvTranspose1d,
    QuantConvTranspose2d,
    QuantConvTranspose3d,
)
from netquant.nn.modules.conv_bn import (
    CONV_BN_TYPES,
    ConvBn1d,
    ConvBn2d,
    ConvBn3d,
    QuantConvBn1d,
    QuantConvBn2d,
    QuantConvBn3d,
)
from netquant.nn.modules.embedding import QuantEmbedding
from netquant.nn.modules.functional import QuantAdd, QuantCat, QuantMatmul
from netquant.nn.modules.linear import QuantLinear
from netquant.nn.modules.pooling import (
    QuantAdaptiveAvgPool1d,
    QuantAdaptiveAvgPool2d,
    QuantAdaptiveAvgPool3d,
    QuantAvgPool1d,
    QuantAvgPool2d,
    QuantAvgPool3d,
)
from netquant.nn.modules.rnn import QuantLSTM

FLOAT_TO_QUANT = {
    cls.float_type: cls
    for cls in (QuantLinear, QuantConv1d, QuantConv2d, QuantConv3d, QuantConvTranspose1d, QuantConvTranspose2d,
                QuantConvTranspose3d, QuantAvgPool1d, QuantAvgPool2d, QuantAvgPool3d, QuantAdaptiveAvgPool1d,
                QuantAdaptiveAvgPool2d, QuantAdaptiveAvgPool3d, QuantLSTM, QuantEmbedding, QuantConvBn1d,
                QuantConvBn2d, QuantConvBn3d)
}
FUNCTIONAL_SITES = (QuantAdd, QuantMatmul, QuantCat)

__all__ = [
    "CONV_BN_TYPES", "ConvBn1d", "ConvBn2d", "ConvBn3d", "QuantConvBn1d", "QuantConvBn2d", "QuantConvBn3d",
    "FLOAT_TO_QUANT", "FUNCTIONAL_SITES", "QuantAdaptiveAvgPool1d", "QuantAdaptiveAvgPool2d", "QuantAdaptiveAvgPool3d",
    "QuantAdd", "QuantAvgPool1d", "QuantAvgPool2d", "QuantAvgPool3d", "QuantCat", "QuantConv1d", "QuantConv2d",
    "QuantConv3d", "QuantConvTranspose1d", "QuantConvTranspose2d", "QuantConvTranspose3d", "QuantEmbedding",
    "QuantLSTM", "QuantLinear", "QuantMatmul", "QuantModule",
]
