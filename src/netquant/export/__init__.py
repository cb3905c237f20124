"""netquant.export: ONNX QDQ models, OpenVINO IR, TFLite models, ncnn int8 models, quant-params JSON and TensorRT
calibration caches (netquant.export.formats: which file a path asks for).

Every file is validated before it is written and written whole or not at all.
"""

from netquant.export.ncnn import NcnnExportReport, export_ncnn
from netquant.export.onnx_qdq import ExportReport, build_qdq_model, export_qdq
from netquant.export.ort_kernels import INT8_KERNEL_OPS, ort_int8_kernels, ort_optimized_op_types
from netquant.export.params import (
    export_quant_params_json,
    export_trt_calibration_cache,
    quant_params,
    scale_hex,
    trt_scales,
)
from netquant.export.tflite import TfliteExportReport, export_tflite

__all__ = [
    "INT8_KERNEL_OPS",
    "ExportReport",
    "NcnnExportReport",
    "TfliteExportReport",
    "build_qdq_model",
    "export_ncnn",
    "export_qdq",
    "export_quant_params_json",
    "export_tflite",
    "export_trt_calibration_cache",
    "ort_int8_kernels",
    "ort_optimized_op_types",
    "quant_params",
    "scale_hex",
    "trt_scales",
]
