"""netquant.core: quantization numerics (specs, rounding, qparams, quantize / fake-quantize)."""

from netquant.core.amax_quant import fake_tensor_quant, tensor_quant
from netquant.core.ops import GradMode, dequantize, fake_quantize, param_shape, quantize
from netquant.core.qparams import QParams, choose_qparams
from netquant.core.rounding import round_with_policy
from netquant.core.spec import Granularity, QuantFormat, QuantSpec, RoundingPolicy, ScaleConstraint

__all__ = [
    "GradMode",
    "Granularity",
    "QParams",
    "QuantFormat",
    "QuantSpec",
    "RoundingPolicy",
    "ScaleConstraint",
    "choose_qparams",
    "dequantize",
    "fake_quantize",
    "fake_tensor_quant",
    "param_shape",
    "quantize",
    "round_with_policy",
    "tensor_quant",
]
