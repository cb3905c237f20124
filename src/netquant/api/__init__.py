"""Python API: quantize_onnx / quantize_torch and the QuantizedModel they return."""

from netquant.api.model import ExportKind, QuantizedModel
from netquant.api.quantize import quantize_onnx, quantize_torch

__all__ = ["ExportKind", "QuantizedModel", "quantize_onnx", "quantize_torch"]
