"""Python API: quantize_onnx / quantize_torch and the QuantizedModel they return."""

from netquant.api.model import QuantizedModel
from netquant.api.quantize import quantize_onnx, quantize_torch

__all__ = ["QuantizedModel", "quantize_onnx", "quantize_torch"]
