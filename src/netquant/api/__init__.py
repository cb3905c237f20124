"""Python API: quantize_onnx / quantize_torch and the QuantizedModel they return."""

from netquant.analysis.placement import Placement
from netquant.api.model import ExportKind, QuantizedModel
from netquant.api.quantize import quantize_onnx, quantize_torch
from netquant.api.weight_only import export_weight_only, quantize_weights
from netquant.passes.settings import Objective

__all__ = ["ExportKind", "Objective", "Placement", "QuantizedModel", "export_weight_only", "quantize_onnx", "quantize_torch",
           "quantize_weights"]
