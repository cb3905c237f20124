"""Quantization parameters as JSON and as a TensorRT calibration cache.

TensorRT cache text: a header `TRT-<version>-EntropyCalibration2`, then one line per tensor
`<tensor name>: <8 hex digits>`, the IEEE-754 float32 bits (big-endian) of the symmetric int8 scale
s = amax / 127.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from netquant.atomic import write_text_atomic
from netquant.errors import ExportError
from netquant.export.slots import Exportable, emits, iter_slots, params_of, root, unwrap


def _floats(t: torch.Tensor) -> float | list[float]:
    values = [float(v) for v in t.detach().float().cpu().reshape(-1).tolist()]
    return values[0] if t.dim() == 0 else values


def _ints(t: torch.Tensor) -> int | list[int]:
    values = [int(v) for v in t.detach().cpu().reshape(-1).tolist()]
    return values[0] if t.dim() == 0 else values


def quant_params(qmodel: Exportable) -> dict[str, Any]:
    """Every config of every op: tensor, place, state, spec, scale, zero point and real range; and the repair
    passes' records (`repairs`), when any ran."""
    qgraph = unwrap(qmodel)
    records = []
    for slot in iter_slots(qgraph):
        cfg = slot.config
        spec = root(cfg).spec if cfg.dominated_by is not None else cfg.spec
        rec: dict[str, Any] = {
            "tensor": slot.tensor,
            "node": slot.node,
            "op_type": slot.op_type,
            "place": f"{'input' if slot.is_input else 'output'}:{slot.index}",
            "state": cfg.state.name,
            "is_constant": slot.tensor in qgraph.graph.initializers,
            "bits": spec.bits,
            "signed": spec.signed,
            "symmetric": spec.symmetric,
            "format": spec.fmt.value,
            "granularity": spec.granularity.value,
            "axis": spec.axis,
            "quant_min": spec.qmin if not spec.is_float else None,
            "quant_max": spec.qmax if not spec.is_float else None,
            "rounding": spec.rounding.value,
        }
        if cfg.dominated_by is not None:
            rec["shares_params_with"] = root(cfg).name
        if root(cfg).params is not None:
            scale, zp, _ = params_of(cfg)
            rec["scale"], rec["zero_point"] = _floats(scale), _ints(zp)
            if spec.is_float:
                lo, hi = -spec.fp_max * scale, spec.fp_max * scale
            else:
                lo, hi = (spec.qmin - zp.float()) * scale, (spec.qmax - zp.float()) * scale
            rec["range"] = [_floats(lo), _floats(hi)]
        records.append(rec)
    out: dict[str, Any] = {
        "format": "netquant-quant-params/1",
        "model": qgraph.graph.name,
        "platform": qgraph.platform.name,
        "opset": qgraph.graph.opset,
        "configs": records,
    }
    repairs = getattr(qgraph, "repairs", None)
    if repairs:  # what the repair passes (SmoothQuant, equalization, AdaRound) changed, in run order
        out["repairs"] = [r.as_dict() for r in repairs]
    return out


def export_quant_params_json(qmodel: Exportable, path: str | os.PathLike[str],
                             vs_fp32: list[dict[str, Any]] | None = None) -> Path:
    """Write quant_params(qmodel) as indented JSON, whole or not at all. vs_fp32: the model files' comparisons with
    FP32 in their engines (export.fidelity.EngineComparison.as_dict), stored under "vs_fp32" when given."""
    params = quant_params(qmodel)
    if vs_fp32 is not None:
        params["vs_fp32"] = vs_fp32
    try:
        text = json.dumps(params, indent=1, allow_nan=False) + "\n"
    except ValueError as exc:  # a NaN / Inf scale or range: calibration saw activations beyond float32
        bad = [r["tensor"] for r in params["configs"] if "NaN" in json.dumps(r) or "Infinity" in json.dumps(r)]
        raise ExportError(f"quant-params JSON '{path}': tensors {bad[:5] or '?'} have non-finite scales or ranges "
                          "(calibration saw Inf activations); calibrate on data in the model's range") from exc
    return write_text_atomic(path, text, "quant-params JSON")


def scale_hex(scale: float) -> str:
    """8 hex digits of the float32 bits of `scale` (TensorRT cache encoding)."""
    return f"{struct.unpack('>I', struct.pack('>f', float(scale)))[0]:08x}"


def trt_scales(qmodel: Exportable) -> dict[str, float]:
    """Per-tensor symmetric int8 scale (amax / 127) of every quantized activation, in graph order.

    A tensor's producer-output quantizer wins over its consumers'; affine params are converted to the
    symmetric amax = max(|lo|, |hi|) of their representable range.
    """
    qgraph = unwrap(qmodel)
    chosen: dict[str, Any] = {}
    for slot in iter_slots(qgraph):
        if slot.tensor in qgraph.graph.initializers or not emits(slot.config):
            continue
        if slot.tensor not in chosen or not slot.is_input:
            chosen[slot.tensor] = slot.config
    scales: dict[str, float] = {}
    for tensor, cfg in chosen.items():
        scale, zp, spec = params_of(cfg)
        if spec.is_float:
            amax = (spec.fp_max * scale).abs().max()
        else:
            lo, hi = (spec.qmin - zp.float()) * scale, (spec.qmax - zp.float()) * scale
            amax = torch.maximum(lo.abs(), hi.abs()).max()
        scales[tensor] = float(amax) / 127.0
    return scales


def export_trt_calibration_cache(qmodel: Exportable, path: str | os.PathLike[str], *, trt_version: str = "8601",
                                 algorithm: str = "EntropyCalibration2") -> Path:
    """Write a TensorRT calibration cache for the quantized activations (whole or not at all)."""
    lines = [f"TRT-{trt_version}-{algorithm}"]
    lines += [f"{name}: {scale_hex(s)}" for name, s in trt_scales(qmodel).items()]
    return write_text_atomic(path, "\n".join(lines) + "\n", "TensorRT calibration cache")

