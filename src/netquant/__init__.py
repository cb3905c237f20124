"""netquant: quantize neural networks for real inference engines."""

from netquant.core.amax_quant import fake_tensor_quant, tensor_quant
from netquant.core.ops import GradMode, dequantize, fake_quantize, quantize
from netquant.core.qparams import QParams, choose_qparams
from netquant.core.qtensor import QTensor
from netquant.core.spec import Granularity, QuantFormat, QuantSpec, RoundingPolicy, ScaleConstraint
from netquant.core.tensor_config import QuantState, TensorQuantConfig
from netquant.errors import (
    CalibrationError,
    ConfigError,
    DataError,
    ExportError,
    FloatResultError,
    ModelError,
    NetquantError,
    UnsupportedOpError,
)

__version__ = "0.1.0"

__all__ = [
    "CalibrationError",
    "ConfigError",
    "DataError",
    "ExportError",
    "FloatResultError",
    "GradMode",
    "Granularity",
    "ModelError",
    "NetquantError",
    "QParams",
    "QTensor",
    "QuantFormat",
    "QuantSpec",
    "QuantState",
    "RoundingPolicy",
    "ScaleConstraint",
    "TensorQuantConfig",
    "UnsupportedOpError",
    "__version__",
    "choose_qparams",
    "dequantize",
    "fake_quantize",
    "fake_tensor_quant",
    "quantize",
    "tensor_quant",
]


_API_NAMES = ("quantize_onnx", "quantize_torch", "QuantizedModel", "Objective")


def __getattr__(name: str) -> object:
    """Lazy access to the PTQ API (netquant.quantize_onnx, ...) without importing it at package import."""
    if name in _API_NAMES:
        from netquant import api

        return getattr(api, name)
    raise AttributeError(f"module 'netquant' has no attribute '{name}'")
