"""netquant.export.tflite: QuantizedGraph -> .tflite (TFLite flatbuffer schema), int8 ops with netquant's scales,
NHWC, checked in LiteRT. Needs the `tflite` extra (ai-edge-litert, flatbuffers)."""

from netquant.export.tflite.export import TfliteExportReport, build_tflite, export_tflite

__all__ = ["TfliteExportReport", "build_tflite", "export_tflite"]
