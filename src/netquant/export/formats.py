"""Which file an export writes: the format a path's suffix picks, the companion files written beside it
(OpenVINO's .bin, ncnn's .bin and .table), and the writer. One table for QuantizedModel.export and the CLI."""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from netquant.errors import ConfigError


class ExportKind(enum.StrEnum):
    """Which file QuantizedModel.export writes (the platform decides the QDQ flavour)."""

    QDQ = "qdq"  # ONNX QuantizeLinear / DequantizeLinear model
    JSON = "json"  # every tensor's quantization params
    TENSORRT_CACHE = "tensorrt_cache"  # TensorRT calibration cache
    OPENVINO_IR = "openvino_ir"  # OpenVINO IR: model.xml + model.bin (a .xml path)
    TFLITE = "tflite"  # TFLite / LiteRT flatbuffer: int8 ops with netquant's scales, NHWC input (a .tflite path)
    NCNN = "ncnn"  # ncnn int8 model: .param + .bin + ncnn's int8 .table (a .param path)

    @classmethod
    def for_path(cls, path: str | os.PathLike[str], models_only: bool = False, option: str = "export path"
                 ) -> ExportKind:
        """The format a path's suffix asks for: .onnx ONNX QDQ, .xml OpenVINO IR, .tflite TFLite, .param ncnn,
        .json quant-params JSON, .cache TensorRT calibration cache (models_only: the model formats only).

        ConfigError naming the path for any other suffix (.bin is a companion, not a model; no suffix is no
        format): nothing is written under a name its readers would misread."""
        if Path(path).name == "-":
            raise ConfigError(f"{option} '-': netquant writes files, not standard output; give a file name")
        kind = _BY_SUFFIX.get(Path(path).suffix.lower())
        if kind is None or (models_only and kind not in MODEL_KINDS):
            known = {k: v for k, v in _BY_SUFFIX.items() if not models_only or v in MODEL_KINDS}
            raise ConfigError(f"{option} '{path}': the suffix '{Path(path).suffix or '(none)'}' names no format "
                              f"netquant writes; use {', '.join(f'{k} ({v.label})' for k, v in known.items())}")
        return kind

    @property
    def label(self) -> str:
        return {ExportKind.QDQ: "ONNX QDQ", ExportKind.JSON: "quant-params JSON",
                ExportKind.TENSORRT_CACHE: "TensorRT calibration cache", ExportKind.OPENVINO_IR: "OpenVINO IR",
                ExportKind.TFLITE: "TFLite", ExportKind.NCNN: "ncnn"}[self]

    @property
    def engine(self) -> str:
        """The engine that runs (and validates) this format by default."""
        return {ExportKind.OPENVINO_IR: "OpenVINO", ExportKind.TFLITE: "LiteRT", ExportKind.NCNN: "ncnn"}.get(
            self, "onnxruntime")


@dataclass(frozen=True)
class Companion:
    """A file written together with the main one: its suffix, the writer's keyword for its path, what it is."""

    suffix: str
    keyword: str
    what: str

    def default_path(self, path: str | os.PathLike[str]) -> Path:
        return Path(path).with_suffix(self.suffix)


_BY_SUFFIX = {".onnx": ExportKind.QDQ, ".xml": ExportKind.OPENVINO_IR, ".tflite": ExportKind.TFLITE,
              ".param": ExportKind.NCNN, ".json": ExportKind.JSON, ".cache": ExportKind.TENSORRT_CACHE}
MODEL_KINDS = (ExportKind.QDQ, ExportKind.OPENVINO_IR, ExportKind.TFLITE, ExportKind.NCNN)  # what `-o` writes

COMPANIONS: dict[ExportKind, tuple[Companion, ...]] = {
    ExportKind.OPENVINO_IR: (Companion(".bin", "bin_path", "OpenVINO IR weights"),),
    ExportKind.NCNN: (Companion(".bin", "bin_path", "ncnn weights"), Companion(".table", "table_path", "ncnn int8 table")),
}


def companions(kind: ExportKind) -> tuple[Companion, ...]:
    return COMPANIONS.get(kind, ())


def writer(kind: ExportKind) -> Callable[..., Any]:
    """The export function for `kind`: writer(qgraph, path, **options) (engine exporters imported on demand)."""
    if kind is ExportKind.OPENVINO_IR:
        from netquant.export.openvino import export_openvino

        return export_openvino
    if kind is ExportKind.NCNN:
        from netquant.export.ncnn import export_ncnn

        return export_ncnn
    if kind is ExportKind.TFLITE:
        from netquant.export.tflite import export_tflite

        return export_tflite
    from netquant.export.onnx_qdq import export_qdq
    from netquant.export.params import export_quant_params_json, export_trt_calibration_cache

    return {ExportKind.QDQ: export_qdq, ExportKind.JSON: export_quant_params_json,
            ExportKind.TENSORRT_CACHE: export_trt_calibration_cache}[kind]
