"""export_tflite: a QuantizedGraph -> a .tflite file that LiteRT runs with int8 kernels, checked in LiteRT."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from netquant.atomic import atomic_path
from netquant.core.int_kernels import Accumulation
from netquant.errors import ExportError
from netquant.export.fidelity import DEFAULT_MIN_COSINE, check_vs_fp32, compare_with_fp32
from netquant.export.onnx_qdq import ExportReport, _fp32_bytes, _version
from netquant.export.slots import Exportable, check_deployable, unwrap
from netquant.export.tflite.convert import Converter, record
from netquant.export.tflite.ops import CONVERTERS, find_hard_swish
from netquant.export.tflite.schema import litert_version, schema
from netquant.export.tflite.validate import check_shapes, compare_with_litert, load_interpreter
from netquant.export.validate import DEFAULT_MAX_ERROR_RATIO, validation_feeds
from netquant.passes.quant_graph import QuantizedGraph


@dataclass
class TfliteExportReport(ExportReport):
    """ExportReport for a .tflite file: int8_kernels counts the file's int8 TFLite operators, quantize_nodes /
    dequantize_nodes its QUANTIZE / DEQUANTIZE operators; float_ops names the ops left in float."""

    input_shapes: dict[str, tuple[int, ...]] | None = None  # as the file takes them (4-D: NHWC)
    float_ops: list[str] | None = None
    total_ops: int = 0

    def summary(self) -> str:
        cos = ", ".join(f"{k}: {v:.5f}" for k, v in self.output_cosine.items()) or "not validated"
        kernels = ", ".join(f"{k} x{v}" for k, v in (self.int8_kernels or {}).items()) or "none"
        shapes = ", ".join(f"{k} {list(v)}" for k, v in (self.input_shapes or {}).items())
        checked = f" over {self.validation_batches} batch(es) in {self.validated_with}" if self.validated else ""
        return (f"{self.path}: TFLite, inputs {shapes} (4-D inputs NHWC, float32), {self.total_ops} operators, "
                f"{self.quantize_nodes} QUANTIZE / {self.dequantize_nodes} DEQUANTIZE, "
                f"{len(self.float_ops or [])} ops in float; {self.fp32_bytes / 1e6:.2f} MB -> "
                f"{self.size_bytes / 1e6:.2f} MB ({self.compression:.1f}x); cosine vs fake-quant {cos}{checked}; "
                f"LiteRT int8 ops: {kernels}" + (f"; {self.vs_fp32.line()}" if self.vs_fp32 is not None else ""))


def static_inputs(qgraph: QuantizedGraph, feeds: dict[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """The file's fixed input shapes: the validation batch's, with batch 1 where the model's batch is dynamic."""
    shapes: dict[str, tuple[int, ...]] = {}
    for v in qgraph.graph.inputs:
        if v.name in qgraph.graph.initializers:
            continue
        x = feeds.get(v.name)
        if x is None:
            raise ExportError(f"TFLite export: no validation data for input '{v.name}'")
        model = list(v.shape or ())
        if model and len(model) != x.ndim:
            raise ExportError(f"TFLite export: input '{v.name}' has rank {len(model)} but the sample {x.shape}")
        shape = list(x.shape)
        if shape and not (model and isinstance(model[0], int) and model[0] > 0):
            shape[0] = 1
        if any(d <= 0 for d in shape):
            raise ExportError(f"TFLite export needs static input shapes: input '{v.name}' gets {tuple(x.shape)}; "
                              "pass sample=... with a real batch")
        shapes[v.name] = tuple(int(d) for d in shape)
    return shapes


def build_tflite(qmodel: Exportable, sample: Any = None) -> tuple[bytes, Converter, dict[str, tuple[int, ...]]]:
    """The .tflite bytes (not validated, not written), the converter (stats) and the input shapes."""
    qgraph = unwrap(qmodel)
    check_deployable(qgraph)
    schema()
    feeds = validation_feeds(qgraph, sample)[0]
    shapes = static_inputs(qgraph, feeds)
    one = {k: np.ascontiguousarray(feeds[k][: shapes[k][0]]) if shapes[k] else feeds[k] for k in shapes}
    rec = record(qgraph, one)
    cv = Converter(qgraph, rec, CONVERTERS)
    find_hard_swish(cv)
    cv.convert(list(shapes), shapes)
    return cv.w.to_bytes(f"netquant {_version()} ({qgraph.platform.name})"), cv, shapes


def export_tflite(qmodel: Exportable, path: str | os.PathLike[str], *, validate: bool = True, sample: Any = None,
                  min_cosine: float = 0.98, max_error_ratio: float | None = DEFAULT_MAX_ERROR_RATIO,
                  threads: int | None = None, min_fp32_cosine: float | None = DEFAULT_MIN_COSINE) -> TfliteExportReport:
    """Write `qmodel` as a TFLite flatbuffer at `path`, whole or not at all.

    Fixed shapes from `sample` (else the kept calibration batches), batch 1 where the model's batch is dynamic;
    4-D inputs are NHWC float32 (TFLite's layout), outputs float32 in the ONNX model's shapes. Ops netquant
    quantizes become int8 TFLite ops carrying its scales; the rest run in float between QUANTIZE / DEQUANTIZE.
    validate: LiteRT loads the file, its tensor shapes match, and on the validation batches every output is as
        close to FP32 as netquant's fake-quant run (validate.Agreement; max_error_ratio None: cosine(LiteRT,
        fake-quant) >= min_cosine). LiteRT's outputs are compared with the FP32 model in onnxruntime
        (export.fidelity, vs_fp32); an output below min_fp32_cosine is refused (None: no check).
    Raises ExportError (and leaves no file) on any failure.
    """
    start = time.perf_counter()
    qgraph = unwrap(qmodel)
    where = str(path)
    data, cv, shapes = build_tflite(qgraph, sample)
    batches = validation_feeds(qgraph, sample) if validate else []
    agreement = {}
    vs_fp32 = None
    with atomic_path(path, "TFLite model") as tmp:
        Path(tmp).write_bytes(data)
        if validate:
            interp = load_interpreter(tmp, where, threads)
            check_shapes(interp, {t.index: t.shape for t in cv.w.info}, where)
            names = list(shapes)
            cl = [len(shapes[n]) == 4 for n in names]
            outputs = [v.name for v in qgraph.graph.outputs]
            lite: dict[str, list[np.ndarray]] = {}
            agreement = compare_with_litert(qgraph, interp, batches, names, cl, outputs, where, min_cosine,
                                            max_error_ratio, record=lite)
            vs_fp32 = compare_with_fp32(qgraph, lite, batches, "LiteRT", sample_given=sample is not None)
            check_vs_fp32(vs_fp32, min_fp32_cosine, where)
    target = Path(path)
    ops = [op for op, _ in cv.w.op_types]
    consts = sum(1 for t in cv.w.info if t.quant is not None and cv.w.tensors[t.index].buffer)
    return TfliteExportReport(
        path=target, opset=qgraph.graph.opset, source_opset=qgraph.graph.opset, fp32_bytes=_fp32_bytes(qgraph),
        size_bytes=target.stat().st_size, quantize_nodes=ops.count("QUANTIZE"),
        dequantize_nodes=ops.count("DEQUANTIZE"), integer_initializers=consts,
        quantized_ops=[n.name for n in qgraph.graph.nodes if f"{n.op_type} '{n.name}'" not in cv.float_ops
                       and qgraph.op_configs.get(n.name) is not None and qgraph.op_configs[n.name].is_quantized],
        validated=validate,
        validated_with=f"LiteRT interpreter (ai-edge-litert {litert_version()}, this CPU)" if validate else "",
        output_cosine={k: a.ort_vs_fake_quant for k, a in agreement.items()},
        output_max_abs_diff={k: a.max_abs_diff for k, a in agreement.items()}, validation_batches=len(batches),
        accumulation=Accumulation.EXACT if validate else None, cpu_target=None,
        int8_kernels=cv.w.int8_op_counts(), runtime_qdq=ops.count("QUANTIZE") + ops.count("DEQUANTIZE"),
        warnings=[], seconds=time.perf_counter() - start, vs_fp32=vs_fp32,
        input_shapes={k: (v[0], *v[2:], v[1]) if len(v) == 4 else v for k, v in shapes.items()},
        float_ops=list(cv.float_ops), total_ops=len(ops))
