"""netquant: quantize neural networks for real inference engines.

The names below are imported on first use (PEP 562), so `import netquant` and the `netquant` command start without
loading torch: a Ctrl-C while torch loads then reaches the command's handler (one line, exit status 130).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

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

if TYPE_CHECKING:
    from netquant.api import Objective as Objective
    from netquant.api import QuantizedModel as QuantizedModel
    from netquant.api import quantize_onnx as quantize_onnx
    from netquant.api import quantize_torch as quantize_torch
    from netquant.api import quantize_weights as quantize_weights
    from netquant.core.amax_quant import fake_tensor_quant, tensor_quant
    from netquant.core.ops import GradMode, dequantize, fake_quantize, quantize
    from netquant.core.qparams import QParams, choose_qparams
    from netquant.core.qtensor import QTensor
    from netquant.core.spec import Granularity, QuantFormat, QuantSpec, RoundingPolicy, ScaleConstraint
    from netquant.core.tensor_config import QuantState, TensorQuantConfig

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

# name -> the module that defines it (imported on first access)
_LAZY = {
    **dict.fromkeys(("fake_tensor_quant", "tensor_quant"), "netquant.core.amax_quant"),
    **dict.fromkeys(("GradMode", "dequantize", "fake_quantize", "quantize"), "netquant.core.ops"),
    **dict.fromkeys(("QParams", "choose_qparams"), "netquant.core.qparams"),
    "QTensor": "netquant.core.qtensor",
    **dict.fromkeys(("Granularity", "QuantFormat", "QuantSpec", "RoundingPolicy", "ScaleConstraint"),
                    "netquant.core.spec"),
    **dict.fromkeys(("QuantState", "TensorQuantConfig"), "netquant.core.tensor_config"),
    **dict.fromkeys(("quantize_onnx", "quantize_torch", "quantize_weights", "export_weight_only", "QuantizedModel",
                     "Objective"), "netquant.api"),
}


def __getattr__(name: str) -> object:
    """The public names on first access (netquant.quantize_onnx, netquant.QuantSpec, ...)."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'netquant' has no attribute '{name}'")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
