"""export_onnx: a QDQ ONNX model from a quantized PyTorch model.

Each enabled quantizer becomes QuantizeLinear -> DequantizeLinear (per-channel weights carry their
``axis``, per-group weights a ``block_size`` at opset 21).  Weights enter already fake-quantized,
so the exported integers equal ours whatever the rounding policy; activations use ONNX's
round-half-even.  A weight's Q -> DQ pair is then folded into an initializer of its quantized type (int4 / int8 /
FP8 ...) read by the DequantizeLinear (netquant.nn.integer_weights), so files shrink with the bits.  Export goes through ``torch_to_onnx``, netquant's one torch -> ONNX path (torch.onnx's
torch.export-based exporter at opset EXPORT_OPSET = 21, also used by ``netquant.api.quantize_torch``),
with a custom translation of the ``netquant::qdq`` op; the file is written whole or not at all.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import torch
from torch import nn

from netquant.atomic import atomic_path
from netquant.errors import ExportError
from netquant.nn import _qdq_op  # noqa: F401  (registers netquant::qdq)
from netquant.nn.convert import name_quantizers, quant_modules, quantizers
from netquant.nn.integer_weights import fold_weight_qdq
from netquant.nn.quantizer import EXPORTING, QuantMode

EXPORT_OPSET = 21
"""netquant's one torch -> ONNX path (`torch_to_onnx`, used by export_onnx and api.quantize_torch) is torch.onnx's
torch.export-based ("dynamo") exporter at ai.onnx opset 21.  Dynamo, because it is the exporter that takes a
translation of the netquant::qdq custom op (custom_translation_table) and the one torch keeps developing (the
TorchScript exporter is deprecated); opset 21, because it is the first with int4/uint4 and blocked (per-group)
QuantizeLinear, which the module presets need, and onnxruntime, OpenVINO and netquant's graph IR load it.
An opset from MIN_OPSET up can be asked for (older ones: the exporter cannot emit them)."""
MIN_OPSET = 18


def _qdq_translation(opset: int) -> Any:
    try:
        from onnxscript import values as onnxscript_values  # needed by torch.onnx's dynamo exporter
    except ImportError as exc:
        raise ExportError("export_onnx needs the onnxscript package (pip install onnxscript)") from exc
    op = onnxscript_values.Opset("", opset)

    def qdq_onnx(x: Any, scale: Any, zero_point: Any, axis: int, block_size: int, onnx_type: int,
                 clip_lo: float, clip_hi: float) -> Any:
        if clip_lo > -math.inf or clip_hi < math.inf:  # bounds as Constant nodes of x's type (see _qdq_op)
            x = op.Clip(x, op.CastLike(op.Constant(value_float=clip_lo), x),
                        op.CastLike(op.Constant(value_float=clip_hi), x))
        zp = op.Cast(zero_point, to=onnx_type)
        if block_size > 0:
            q = op.QuantizeLinear(x, scale, zp, axis=axis, block_size=block_size)
            return op.DequantizeLinear(q, scale, zp, axis=axis, block_size=block_size)
        q = op.QuantizeLinear(x, scale, zp, axis=axis)
        return op.DequantizeLinear(q, scale, zp, axis=axis)

    return qdq_onnx


def _check_exportable(model: nn.Module) -> None:
    name_quantizers(model)
    calibrating = [n for n, q in quantizers(model) if q.mode is QuantMode.CALIBRATE]
    if calibrating:
        raise ExportError(f"export_onnx: quantizers still in calibration mode: {', '.join(calibrating)}; "
                          "leave the `with calibrate(model):` block before exporting")
    active = [(n, q) for n, q in quantizers(model) if q.mode is QuantMode.QUANTIZE]
    dynamic = [n for n, q in active if q.dynamic]
    if dynamic:
        raise ExportError(f"export_onnx: dynamic (per-batch) quantizers cannot be exported as static QDQ: "
                          f"{', '.join(dynamic)}; calibrate a static model instead")
    uncalibrated = [n for n, q in active if not q.is_calibrated]
    if uncalibrated:
        raise ExportError(f"export_onnx: {len(uncalibrated)} quantizer(s) have no params: "
                          f"{', '.join(uncalibrated)}; calibrate the model before exporting")


def _install_plans(model: nn.Module, opset: int) -> list[Any]:
    installed = []
    with torch.no_grad():
        weights = {id(q): w for m in quant_modules(model) for q, w in m.weight_tensors()}
        for _, quantizer in quantizers(model):
            if quantizer.mode is not QuantMode.QUANTIZE:
                continue
            weight = weights.get(id(quantizer))
            fq_weight = None if weight is None else quantizer(weight.detach())
            quantizer._export_plan = _qdq_op.make_export_plan(
                quantizer, opset, None if weight is None else weight.dim(), fq_weight)
            installed.append(quantizer)
    return installed


@contextlib.contextmanager
def _quiet_exporter_logs() -> Iterator[None]:
    """Silence torch.onnx's info/warning logs (e.g. 'torchvision is not installed') during export."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _check_opset(opset: int, what: str) -> None:
    if not isinstance(opset, int) or opset < MIN_OPSET:
        raise ExportError(f"{what}: opset {opset} is too old; torch.onnx's torch.export-based exporter (the one "
                          f"netquant uses) needs opset >= {MIN_OPSET}; the default is {EXPORT_OPSET}")


def torch_to_onnx(model: nn.Module, args: tuple[Any, ...], *, opset: int = EXPORT_OPSET,
                  input_names: Sequence[str] | None = None, output_names: Sequence[str] | None = None,
                  dynamic_batch: bool = False, dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
                  custom_translation_table: Mapping[Any, Any] | None = None,
                  what: str = "torch_to_onnx", kwargs: Mapping[str, Any] | None = None,
                  dynamic_shapes: Any = None) -> onnx.ModelProto:
    """``model`` traced on ``args`` as a checked ONNX model at ai.onnx opset ``opset``: netquant's one
    torch -> ONNX path (float models for graph PTQ, quantized ones for export_onnx), see EXPORT_OPSET.

    Dynamic dims: ``dynamic_axes`` ({input name: {dim: name}}, names kept in the file) or
    ``dynamic_batch`` (dim 0 of every tensor input), or torch.export's ``dynamic_shapes`` as given (e.g. keyed by
    the names of ``kwargs``, keyword inputs passed to the model's forward).  ExportError (prefixed ``what``) when torch.onnx
    fails, the model fails onnx.checker or the opset is not the one asked for.
    """
    _check_opset(opset, what)
    if dynamic_shapes is None and dynamic_batch and dynamic_axes is None:
        dynamic_shapes = tuple({0: torch.export.Dim.DYNAMIC} if isinstance(a, torch.Tensor) else None for a in args)
    try:
        with warnings.catch_warnings(), _quiet_exporter_logs():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                model, args, kwargs=dict(kwargs) if kwargs else None, dynamo=True, opset_version=opset, verbose=False,
                input_names=list(input_names) if input_names else None,
                output_names=list(output_names) if output_names else None,
                dynamic_shapes=dynamic_shapes,
                dynamic_axes={k: dict(v) for k, v in dynamic_axes.items()} if dynamic_axes else None,
                custom_translation_table=dict(custom_translation_table) if custom_translation_table else None,
            )
        proto = program.model_proto
        onnx.checker.check_model(proto)
    except Exception as exc:  # torch.onnx raises many kinds; report them as one
        raise ExportError(f"{what}: torch.onnx could not export {type(model).__name__}: {_root_cause(exc)}") from exc
    produced = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    if produced != opset:
        raise ExportError(f"{what}: asked for opset {opset} but torch.onnx produced opset {produced}")
    return proto


_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _root_cause(exc: BaseException) -> str:
    """'Type: first line' of the innermost exception torch.onnx chained (the wrappers only say which of its steps
    failed), without terminal colour codes, at most 300 characters."""
    seen: set[int] = set()
    while exc.__cause__ is not None and id(exc.__cause__) not in seen:
        seen.add(id(exc))
        exc = exc.__cause__
    text = _ANSI.sub("", str(exc)).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(exc).__name__}: {first[:300]}"


def export_onnx(model: nn.Module, example_inputs: torch.Tensor | Sequence[Any], path: str | os.PathLike[str], *,
                opset: int = EXPORT_OPSET, input_names: Sequence[str] | None = None,
                output_names: Sequence[str] | None = None, dynamic_batch: bool = True,
                integer_weights: bool = True) -> Path:
    """Export ``model`` (quantized, calibrated) to a QDQ ONNX file at ``path``; returns the path.

    ``dynamic_batch`` makes dim 0 of every tensor input symbolic (give an example batch >= 2).
    ``integer_weights`` stores quantized weights as initializers of their quantized type read by DequantizeLinear
    (int4 / int8 / FP8 as their spec says, netquant.nn.integer_weights; after QAT too); False keeps float
    weights -> QuantizeLinear.  MatMulNBits files for onnxruntime: netquant.export_weight_only.
    Raises ExportError naming uncalibrated quantizers, or when torch.onnx cannot export the model.
    """
    _check_opset(opset, "export_onnx")
    path = Path(path)
    if not path.parent.exists():
        raise ExportError(f"export_onnx: directory {path.parent} does not exist")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    _check_exportable(model)
    was_training = model.training
    model.eval()
    try:
        _check_example(model, args)
        stashed = _install_plans(model, opset)
    except BaseException:
        model.train(was_training)
        raise
    export_token = EXPORTING.set(True)
    try:
        proto = torch_to_onnx(model, args, opset=opset, input_names=input_names, output_names=output_names,
                              dynamic_batch=dynamic_batch, what="export_onnx",
                              custom_translation_table={torch.ops.netquant.qdq.default: _qdq_translation(opset)})
    finally:
        EXPORTING.reset(export_token)
        for quantizer in stashed:
            quantizer._export_plan = None
        model.train(was_training)
    if integer_weights:
        fold_weight_qdq(proto)
    _write_atomically(proto, path)
    return path


def _check_example(model: nn.Module, args: tuple[Any, ...]) -> None:
    """Run the model once on the example, so a wrong example fails here in one line, not in torch.onnx's log."""
    try:
        with torch.no_grad():
            model(*args)
    except Exception as exc:  # noqa: BLE001 - whatever the forward raises, the example does not fit
        shapes = ", ".join(str(list(a.shape)) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ExportError(f"export_onnx: {type(model).__name__} cannot run on the example inputs ({shapes}): "
                          f"{type(exc).__name__}: {first}; give example_inputs of the shape the model takes") from exc


def _write_atomically(proto: onnx.ModelProto, path: Path) -> None:
    with atomic_path(path, "ONNX model") as tmp:
        onnx.save_model(proto, str(tmp))


__all__ = ["EXPORT_OPSET", "MIN_OPSET", "export_onnx", "torch_to_onnx"]
