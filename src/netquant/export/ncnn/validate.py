"""Validation of an ncnn export by ncnn itself: the int8 model and pnnx's FP32 model run in ncnn on the validation
batches, compared with netquant's executor (fake-quant and FP32) by export.validate's Agreement rule."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from netquant.core.int_kernels import Accumulation
from netquant.errors import ExportError
from netquant.export.ncnn.runner import NcnnRunner, as_numpy
from netquant.export.validate import Agreement, agreement_of, cosine, refuse_zero_outputs, rejected
from netquant.passes.quant_graph import QuantizedGraph

MIN_CONVERSION_COSINE = 0.9999  # pnnx's FP32 ncnn model vs netquant's FP32 executor, every output


@dataclass
class NcnnValidation:
    """Per output (ONNX name): the int8 model's agreement, and how exactly pnnx's FP32 model matches FP32."""

    agreement: dict[str, Agreement]
    conversion_cosine: dict[str, float]
    batches: int
    samples: int
    outputs: dict[str, list[np.ndarray]] = field(default_factory=dict)  # the int8 model's, one array per batch


def validate_ncnn(qgraph: QuantizedGraph, int8: NcnnRunner, fp32: NcnnRunner | None,
                  batches: Sequence[dict[str, np.ndarray]], input_blobs: Sequence[str], output_blobs: Sequence[str],
                  output_names: Sequence[str], where: str, min_cosine: float,
                  max_error_ratio: float | None) -> NcnnValidation:
    """ExportError when pnnx's FP32 model is not the source model (cosine < MIN_CONVERSION_COSINE) or the int8
    model is farther from FP32 than netquant's fake-quant run allows (Agreement.accepted)."""
    fq_ex = qgraph.executor(fake_quant=True, accumulation=Accumulation.EXACT)
    fp_ex = qgraph.executor(fake_quant=False)
    runs: dict[str, dict[str, list[np.ndarray]]] = {n: {"int8": [], "fp32": [], "fq": [], "fp": []}
                                                    for n in output_names}
    samples = 0
    for feeds in batches:
        got = int8.run_batch(feeds, input_blobs, output_blobs)
        ref = fp32.run_batch(feeds, input_blobs, output_blobs) if fp32 is not None else None
        torch_feeds = {k: torch.from_numpy(np.ascontiguousarray(v).reshape(np.shape(v))) for k, v in feeds.items()}
        with torch.no_grad():
            fq, fp = fq_ex.run(torch_feeds), fp_ex.run(torch_feeds)
        samples += int(next(iter(feeds.values())).shape[0])
        for k, name in enumerate(output_names):
            r = as_numpy(fq[name]).astype(np.float32)
            r = r.reshape(r.shape[0], -1)
            if r.shape != got[k].shape:
                raise ExportError(f"ncnn model '{where}': output '{name}' has {got[k].shape[1]} values per sample in "
                                  f"ncnn but {r.shape[1]} in netquant's executor")
            if not np.isfinite(got[k]).all():
                raise ExportError(f"ncnn model '{where}' produces NaN/Inf in output '{name}'")
            e = runs[name]
            e["int8"].append(got[k])
            e["fq"].append(r)
            e["fp"].append(as_numpy(fp[name]).astype(np.float32).reshape(r.shape))
            if ref is not None:
                e["fp32"].append(ref[k])
    agreement: dict[str, Agreement] = {}
    conversion: dict[str, float] = {}
    for name, e in runs.items():
        q, fq_y, fp_y = (np.concatenate([a.ravel() for a in e[k]]) for k in ("int8", "fq", "fp"))
        agreement[name] = agreement_of(q, fq_y, fp_y)
        if e["fp32"]:
            conversion[name] = cosine(np.concatenate([a.ravel() for a in e["fp32"]]), fp_y)
    bad_conv = {k: v for k, v in conversion.items() if v < MIN_CONVERSION_COSINE}
    if bad_conv:
        detail = ", ".join(f"{k}: {v:.6f}" for k, v in bad_conv.items())
        raise ExportError(f"pnnx's FP32 ncnn model of '{where}' does not compute the source model (cosine vs "
                          f"netquant's FP32 executor {detail} < {MIN_CONVERSION_COSINE}); an op pnnx converts "
                          "differently. No file written.")
    refuse_zero_outputs(agreement, where, "ncnn")
    detail = rejected(agreement, min_cosine, max_error_ratio)
    if detail:
        raise ExportError(f"ncnn int8 model '{where}' disagrees with netquant's fake-quant executor over "
                          f"{len(batches)} batch(es) in ncnn: cosine {detail}. Keep the ops `layer_report` names "
                          "in float (force_fp32 / --fp32-ops), or validate=False. No file written.")
    return NcnnValidation(agreement, conversion, len(batches), samples, {n: list(e["int8"]) for n, e in runs.items()})
