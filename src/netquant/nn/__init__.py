"""netquant.nn: quantized PyTorch modules, calibration, QAT and QDQ ONNX export.

    qmodel = quantize_model(model, ModelQuantConfig.int8_tensorrt().keep_float("head.*"))
    with calibrate(qmodel, observer="percentile"):
        for batch in batches:
            qmodel(batch)
    export_onnx(qmodel, example, "model.onnx")
"""

from netquant.nn.calibrate import calibrate
from netquant.nn.convert import quantize_dynamic, quantize_model, quantizers, set_quant_mode
from netquant.nn.export import export_onnx
from netquant.nn.modules import (
    ConvBn1d,
    ConvBn2d,
    ConvBn3d,
    QuantAdaptiveAvgPool1d,
    QuantAdaptiveAvgPool2d,
    QuantAdaptiveAvgPool3d,
    QuantAdd,
    QuantAvgPool1d,
    QuantAvgPool2d,
    QuantAvgPool3d,
    QuantCat,
    QuantConv1d,
    QuantConv2d,
    QuantConv3d,
    QuantConvBn1d,
    QuantConvBn2d,
    QuantConvBn3d,
    QuantConvTranspose1d,
    QuantConvTranspose2d,
    QuantConvTranspose3d,
    QuantEmbedding,
    QuantLinear,
    QuantLSTM,
    QuantMatmul,
    QuantModule,
)
from netquant.nn.qat import fold_batchnorm, freeze_observers, fuse_conv_bn, prepare_qat
from netquant.nn.quantizer import QuantizerRole, QuantMode, TensorQuantizer
from netquant.nn.rules import LayerQuantConfig, ModelQuantConfig, QuantizerConfig, QuantRule, dynamic_config

__all__ = [
    "ConvBn1d", "ConvBn2d", "ConvBn3d", "QuantConvBn1d", "QuantConvBn2d", "QuantConvBn3d", "fuse_conv_bn",
    "LayerQuantConfig", "ModelQuantConfig", "QuantAdaptiveAvgPool1d", "QuantAdaptiveAvgPool2d",
    "QuantAdaptiveAvgPool3d", "QuantAdd", "QuantAvgPool1d", "QuantAvgPool2d", "QuantAvgPool3d", "QuantCat",
    "QuantConv1d", "QuantConv2d", "QuantConv3d", "QuantConvTranspose1d", "QuantConvTranspose2d",
    "QuantConvTranspose3d", "QuantEmbedding", "QuantLSTM", "QuantLinear", "QuantMatmul", "QuantMode",
    "QuantModule", "QuantRule", "QuantizerConfig", "QuantizerRole", "TensorQuantizer", "calibrate",
    "dynamic_config", "export_onnx", "fold_batchnorm", "freeze_observers", "prepare_qat", "quantize_dynamic",
    "quantize_model", "quantizers", "set_quant_mode",
]
