"""export_ncnn: a QuantizedGraph -> ncnn int8 model (.param + .bin) and ncnn's int8 table, validated in ncnn.

Route: netquant's cleaned FP32 graph -> ONNX -> pnnx (FP32 ncnn) -> ncnn2int8's transformation with netquant's
integer weights and calibrated scales (int8.py) -> both models run in ncnn on the validation batches (validate.py).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from netquant.atomic import atomic_path
from netquant.errors import ExportError
from netquant.export.fidelity import DEFAULT_MIN_COSINE, EngineComparison, check_vs_fp32, compare_with_fp32
from netquant.export.ncnn.int8 import INT8_LAYER_TYPES, Int8Layer, apply_int8, plan_int8
from netquant.export.ncnn.param import NcnnParam, can_name_blob, parse_param
from netquant.export.ncnn.pnnx_convert import pnnx_convert, require_engine
from netquant.export.ncnn.runner import NcnnRunner, engine_version
from netquant.export.ncnn.table import table_text
from netquant.export.ncnn.validate import validate_ncnn
from netquant.export.slots import Exportable, check_deployable, unwrap
from netquant.export.validate import DEFAULT_MAX_ERROR_RATIO, validation_feeds

HEAVY_LAYER_TYPES = (*INT8_LAYER_TYPES, "Gemm", "MultiHeadAttention", "Deconvolution", "DeconvolutionDepthWise",
                     "Convolution1D", "ConvolutionDepthWise1D")


@dataclass
class NcnnExportReport:
    """What export_ncnn wrote and how ncnn ran it."""

    path: Path
    bin_path: Path
    table_path: Path | None
    engine: str
    int8_layers: dict[str, int]  # ncnn layer type -> layers with int8_scale_term set
    float_heavy_layers: dict[str, int]  # conv / fc / gemm / attention layers ncnn runs in float
    layers_total: int
    int8_layer_ops: dict[str, str]  # ncnn layer name -> netquant op it came from
    quantized_ops: list[str]
    unmatched_ops: list[str]  # netquant-quantized weighted ops that stay float in ncnn
    validated: bool
    output_cosine: dict[str, float] = field(default_factory=dict)  # ncnn int8 vs fake-quant
    output_cosine_fp32: dict[str, float] = field(default_factory=dict)  # ncnn int8 vs FP32 executor
    fake_quant_cosine_fp32: dict[str, float] = field(default_factory=dict)  # fake-quant vs FP32 executor
    conversion_cosine: dict[str, float] = field(default_factory=dict)  # pnnx FP32 ncnn vs FP32 executor
    output_max_abs_diff: dict[str, float] = field(default_factory=dict)
    validation_batches: int = 0
    validation_samples: int = 0
    validated_with: str = ""
    blob_names: dict[str, str] = field(default_factory=dict)  # ONNX input / output -> ncnn blob
    source_opset: int = 0
    fp32_bytes: int = 0
    size_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    vs_fp32: EngineComparison | None = None  # ncnn's int8 outputs vs the FP32 model in onnxruntime (validated)

    # the fields the CLI summary shows for every export
    @property
    def opset(self) -> int:
        return self.source_opset

    @property
    def opset_upgraded(self) -> bool:
        return False

    @property
    def int8_kernels(self) -> dict[str, int]:
        return dict(self.int8_layers)

    @property
    def runtime_qdq(self) -> None:
        return None

    @property
    def cpu_target(self) -> None:
        return None

    def summary(self) -> str:
        int8 = ", ".join(f"{k} x{v}" for k, v in self.int8_layers.items()) or "none"
        heavy = ", ".join(f"{k} x{v}" for k, v in self.float_heavy_layers.items()) or "none"
        cos = ", ".join(f"{k}: {v:.5f}" for k, v in self.output_cosine.items()) or "not validated"
        checked = (f" over {self.validation_samples} sample(s) in {self.validated_with}" if self.validated else "")
        return (f"{self.path} + {self.bin_path.name}: {sum(self.int8_layers.values())} int8 layers ({int8}) of "
                f"{self.layers_total}; heavy layers in float: {heavy}; {self.fp32_bytes / 1e6:.2f} MB -> "
                f"{self.size_bytes / 1e6:.2f} MB; cosine vs fake-quant {cos}{checked}"
                + (f"; table {self.table_path}" if self.table_path is not None else ""))


def _io_names(qgraph: Any) -> tuple[list[str], list[str]]:
    graph = qgraph.graph
    inputs = [v.name for v in graph.inputs if v.name not in graph.initializers]
    return inputs, list(graph.output_names)


def _by_index(blobs: list[str], prefix: str) -> list[str]:
    """pnnx names the model's inputs / outputs in0, in1.. / out0, out1.. in the ONNX order: sort by that number."""
    if all(b.startswith(prefix) and b[len(prefix):].isdigit() for b in blobs):
        return sorted(blobs, key=lambda b: int(b[len(prefix):]))
    return blobs


def _name_blobs(param: NcnnParam, inputs: list[str], outputs: list[str], where: str) -> dict[str, str]:
    """Rename pnnx's in0.. / out0.. blobs to the model's input / output names where ncnn can hold them."""
    ins, outs = _by_index(param.input_blobs, "in"), _by_index(param.output_blobs(), "out")
    if len(ins) != len(inputs) or len(outs) != len(outputs):
        raise ExportError(f"pnnx's ncnn model of '{where}' has {len(ins)} input(s) / {len(outs)} output(s), the "
                          f"model {len(inputs)} / {len(outputs)}")
    mapping = {}
    taken = set(param.blob_names)
    for onnx_name, blob in zip([*inputs, *outputs], [*ins, *outs]):
        if onnx_name != blob and can_name_blob(onnx_name) and onnx_name not in taken:
            param.rename_blob(blob, onnx_name)
            taken.add(onnx_name)
            blob = onnx_name
        mapping[onnx_name] = blob
    return mapping


def export_ncnn(qmodel: Exportable, path: str | os.PathLike[str], *, bin_path: str | os.PathLike[str] | None = None,
                table_path: str | os.PathLike[str] | None = None, write_table: bool = True,
                fp32_path: str | os.PathLike[str] | None = None, validate: bool = True,
                sample: Any = None, min_cosine: float = 0.99,
                max_error_ratio: float | None = DEFAULT_MAX_ERROR_RATIO, threads: int = 1,
                min_fp32_cosine: float | None = DEFAULT_MIN_COSINE) -> NcnnExportReport:
    """Write `path` (.param), its weights (`bin_path`, default: path with suffix .bin) and ncnn's int8 table
    (`table_path`, default .table; write_table=False: none), whole or not at all. fp32_path: also write pnnx's FP32
    model there (.param, weights beside it as .bin), the model whose layer names the table uses (the input of ncnn's
    own ncnn2int8 tool).

    Conv (Convolution / ConvolutionDepthWise) and fully-connected (InnerProduct) layers whose netquant op is
    quantized run int8 in ncnn with netquant's integer weights and scales; other layers float32. validate: both
    pnnx's FP32 model and the int8 model run in ncnn on the validation batches (`sample`, else the kept calibration
    batches) and must agree with netquant's executor (validate.Agreement; min_cosine when max_error_ratio is None);
    the int8 model's outputs are compared with the FP32 model in onnxruntime (export.fidelity, vs_fp32), refused
    below min_fp32_cosine (None: no check).
    """
    start = time.perf_counter()
    qgraph = unwrap(qmodel)
    check_deployable(qgraph)
    require_engine()
    from netquant.graph import to_onnx
    from netquant.graph.save import fill_output_shapes

    target = Path(path)
    weights_path = Path(bin_path) if bin_path is not None else target.with_suffix(".bin")
    table = (Path(table_path) if table_path is not None else target.with_suffix(".table")) if write_table else None
    where = str(target)
    batches = validation_feeds(qgraph, sample)
    inputs, outputs = _io_names(qgraph)
    shapes = [[1, *batches[0][name].shape[1:]] for name in inputs]
    fp32_model = to_onnx(qgraph.graph, check=False)
    fill_output_shapes(fp32_model, qgraph.graph)
    converted = pnnx_convert(fp32_model, shapes, where)
    param = parse_param(converted.param_text, f"pnnx output for '{where}'")
    blobs = _name_blobs(param, inputs, outputs, where)
    fp32_param_text = param.text()
    plan = plan_int8(param, converted.weights, qgraph, where)
    warnings = list(plan.warnings)
    if not plan.layers:
        warnings.append(f"no layer of '{where}' runs int8 in ncnn: no quantized Conv / Gemm / MatMul op matches an "
                        "ncnn Convolution / ConvolutionDepthWise / InnerProduct layer")
    if plan.unmatched_ops:
        warnings.append(f"{len(plan.unmatched_ops)} quantized op(s) stay float in ncnn (pnnx made them layers ncnn "
                        f"quantizes only with its own dynamic scales, or changed their weights): "
                        f"{', '.join(plan.unmatched_ops[:6])}{' ...' if len(plan.unmatched_ops) > 6 else ''}")
    int8_bin = apply_int8(param, converted.weights, plan.layers, where)
    int8_param_text = param.text()
    input_blobs, output_blobs = [blobs[n] for n in inputs], [blobs[n] for n in outputs]
    validation = None
    vs_fp32 = None
    with contextlib.ExitStack() as stack:
        tmp_param = stack.enter_context(atomic_path(target, "ncnn param"))
        tmp_bin = stack.enter_context(atomic_path(weights_path, "ncnn weights"))
        tmp_table = stack.enter_context(atomic_path(table, "ncnn int8 table")) if table is not None else None
        tmp_param.write_text(int8_param_text, encoding="utf-8")
        tmp_bin.write_bytes(int8_bin)
        if tmp_table is not None:
            tmp_table.write_text(table_text(plan.layers), encoding="utf-8")
        if fp32_path is not None:
            fp32_target = Path(fp32_path)
            stack.enter_context(atomic_path(fp32_target, "FP32 ncnn param")).write_text(fp32_param_text,
                                                                                         encoding="utf-8")
            stack.enter_context(atomic_path(fp32_target.with_suffix(".bin"), "FP32 ncnn weights")).write_bytes(
                converted.weights)
        int8_runner = NcnnRunner(tmp_param, tmp_bin, int8=True, threads=threads, where=where)  # ncnn loads it
        if validate:
            with tempfile.TemporaryDirectory(prefix="netquant-ncnn-") as tmp:
                fp_param, fp_bin = Path(tmp) / "fp32.param", Path(tmp) / "fp32.bin"
                fp_param.write_text(fp32_param_text, encoding="utf-8")
                fp_bin.write_bytes(converted.weights)
                fp32_runner = NcnnRunner(fp_param, fp_bin, int8=False, threads=threads, where=f"{where} (FP32)")
                validation = validate_ncnn(qgraph, int8_runner, fp32_runner, batches, input_blobs, output_blobs,
                                           outputs, where, min_cosine, max_error_ratio)
            vs_fp32 = compare_with_fp32(qgraph, validation.outputs, batches, "ncnn", sample_given=sample is not None)
            check_vs_fp32(vs_fp32, min_fp32_cosine, where)
    types = Counter(la.type for la in param.layers)
    int8_types = Counter(la.layer_type for la in plan.layers)
    heavy = {t: types[t] - int8_types.get(t, 0) for t in HEAVY_LAYER_TYPES if types[t] - int8_types.get(t, 0) > 0}
    agreement = validation.agreement if validation is not None else {}
    return NcnnExportReport(
        path=target, bin_path=weights_path, table_path=table, engine=f"ncnn {engine_version()}",
        int8_layers=dict(sorted(int8_types.items())), float_heavy_layers=heavy, layers_total=len(param.layers),
        int8_layer_ops={la.layer: la.node for la in plan.layers},
        quantized_ops=list(qgraph.quantized_ops()), unmatched_ops=plan.unmatched_ops, validated=validate,
        output_cosine={k: a.ort_vs_fake_quant for k, a in agreement.items()},
        output_cosine_fp32={k: a.ort_vs_fp32 for k, a in agreement.items()},
        fake_quant_cosine_fp32={k: a.fake_quant_vs_fp32 for k, a in agreement.items()},
        conversion_cosine=dict(validation.conversion_cosine) if validation is not None else {},
        output_max_abs_diff={k: a.max_abs_diff for k, a in agreement.items()},
        validation_batches=validation.batches if validation is not None else 0,
        validation_samples=validation.samples if validation is not None else 0,
        validated_with=f"ncnn {engine_version()} (this CPU, int8 inference, {threads} thread(s))" if validate else "",
        blob_names=blobs, source_opset=qgraph.graph.opset, fp32_bytes=len(converted.weights),
        size_bytes=weights_path.stat().st_size + target.stat().st_size, warnings=warnings,
        seconds=time.perf_counter() - start, vs_fp32=vs_fp32)


def int8_layers_of(param: NcnnParam) -> list[str]:
    """Names of the layers with int8_scale_term set (the layers ncnn runs int8)."""
    return [la.name for la in param.layers if la.type in INT8_LAYER_TYPES and la.int_param(8)]


__all__ = ["HEAVY_LAYER_TYPES", "Int8Layer", "NcnnExportReport", "export_ncnn", "int8_layers_of"]
