"""quantize_onnx / quantize_torch: the PTQ entry points."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import torch

from netquant.api.model import QuantizedModel
from netquant.data.calib import calibration_files
from netquant.errors import ExportError, ModelError, UnsupportedOpError
from netquant.graph import Graph, load_onnx, to_onnx
from netquant.nn.export import EXPORT_OPSET, torch_to_onnx
from netquant.outputs import absolute, model_files
from netquant.passes.base import PassBase
from netquant.passes.ptq import run_ptq
from netquant.passes.quant_graph import QuantizedGraph
from netquant.passes.settings import QuantSettings
from netquant.platforms import Platform
from netquant.platforms.platform import Validation

DEFAULT_PLATFORM = "onnxruntime_int8"


class ModelCheckWarning(UserWarning):
    """The input model fails onnx.checker (a warning: onnxruntime and netquant may still run it; exports are checked)."""


def _warn_if_unchecked(model: str | os.PathLike[str] | bytes | onnx.ModelProto, source: str) -> None:
    """onnx.checker on the input is advice, not a gate: models ORT runs load (the export stays checked)."""
    try:
        if isinstance(model, bytes):
            onnx.checker.check_model(onnx.load_from_string(model))
        else:
            onnx.checker.check_model(model if isinstance(model, onnx.ModelProto) else str(model))
    except Exception as exc:  # noqa: BLE001 - checker failures of any kind are reported, not raised
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        warnings.warn(ModelCheckWarning(f"{source}: onnx.checker reports '{first}'; quantizing anyway (the exported "
                                        "model is checked)"), stacklevel=3)


def _load(model: str | os.PathLike[str] | bytes | onnx.ModelProto | Graph) -> tuple[Graph, str]:
    graph, source = _load_graph(model)
    if not isinstance(model, Graph):
        _warn_if_unchecked(model, source)
    return graph, source


def _load_graph(model: str | os.PathLike[str] | bytes | onnx.ModelProto | Graph) -> tuple[Graph, str]:
    if isinstance(model, Graph):
        return model.copy(), model.name
    if isinstance(model, onnx.ModelProto):
        return load_onnx(model), model.graph.name
    if isinstance(model, bytes):
        graph = load_onnx(model)
        return graph, graph.name
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.exists():
            raise ModelError(f"model file '{path}' does not exist")
        return load_onnx(str(path)), str(path)
    raise ModelError(f"model must be a path, serialized ONNX bytes, an onnx.ModelProto or a netquant Graph, got "
                     f"{type(model).__name__}")


_HALF = (torch.float16, torch.bfloat16)


def _check_float32(graph: Graph, source: str) -> None:
    """UnsupportedOpError up front for a model that computes in float16 / bfloat16."""
    halves = [f"input '{v.name}'" for v in graph.inputs if v.dtype in _HALF]
    halves += [f"initializer '{k}'" for k, t in graph.initializers.items() if t.dtype in _HALF]
    if halves:
        raise UnsupportedOpError(
            f"{source or graph.name}: the model computes in float16/bfloat16 ({', '.join(halves[:3])}"
            f"{', ...' if len(halves) > 3 else ''}); netquant quantizes FP32 models. Convert it to FP32 first "
            "(re-export from the framework in float32, or onnxconverter-common's float16 tools) and quantize that")


def quantize_onnx(model: str | os.PathLike[str] | bytes | onnx.ModelProto | Graph, calib_data: Any,
                  platform: str | Platform = DEFAULT_PLATFORM, *, passes: Sequence[PassBase] = (),
                  **settings: Any) -> QuantizedModel:
    """Quantize an ONNX model for `platform` after calibrating on `calib_data`.

    passes: your own netquant.passes.PassBase instances, added to the default passes: they run in order
    after bias quantization and before the final deployability check (so they see calibrated params).
    settings: see netquant.passes.QuantSettings (activation_observer, weight_observer, per_channel,
    force_fp32, overrides, strict, quiet, batch_size, max_calib_batches, ...; placement: objective=
    "latency" | "balanced" (default) | "accuracy" | None, max_loss, metric + eval_data, placement_from;
    see netquant.api.placement).
    """
    t0 = time.perf_counter()
    s = QuantSettings.from_kwargs(platform, settings)
    graph, source = _load(model)
    _check_float32(graph, source)
    timed = s.objective is not None and s.placement_from is None and s.platform.validation is Validation.ONNXRUNTIME
    source_model = to_onnx(graph, check=False) if timed else None  # the speed placement must not fall below
    # the platform's wider format (Platform.wider): placement calibrates the same model in it when first needed
    widens = s.platform.wider is not None and (s.objective is not None or s.placement_from is not None)
    twin_graph = copy.deepcopy(graph) if widens and isinstance(model, Graph) else None
    run = run_ptq(graph, calib_data, s, extra_passes=passes)  # validates calib_data (CheckDataPass), once
    timings = dict(run.timings)
    from netquant.api.placement import place

    wide = None
    if widens and run.calib_data is not None and run.calib_data.num_batches is not None:
        wide_settings = dataclasses.replace(s, platform=s.platform.widened(), objective=None, placement_from=None,
                                            quiet=True)

        def wide() -> QuantizedGraph:
            twin = twin_graph if twin_graph is not None else _load(model)[0]
            return run_ptq(twin, calib_data, wide_settings, extra_passes=passes).qgraph

    t1 = time.perf_counter()
    placement = place(run.qgraph, s, elapsed_s=t1 - t0, source=source_model, wide=wide)  # objective / placement_from: measured INT8-or-float per region
    if placement is not None:
        timings["placement"] = time.perf_counter() - t1
    timings["total"] = time.perf_counter() - t0
    # the validated data is kept for reports (layer_report's default), unless it was a one-shot stream
    kept = run.calib_data if run.calib_data is not None and run.calib_data.num_batches is not None else None
    return QuantizedModel(run.qgraph, source, timings, kept, placement, _read_files(model, calib_data, s))


def _read_files(model: Any, calib_data: Any, s: QuantSettings) -> list[Path]:
    """The files this run read (absolute: the user may chdir before exporting): the model and its external
    data, a calibration file or folder given by path, the placement file."""
    files = model_files(model) if isinstance(model, (str, os.PathLike)) else []
    if isinstance(calib_data, (str, os.PathLike)):
        files += calibration_files(calib_data)
    if s.placement_from is not None:
        files.append(Path(s.placement_from))
    return [absolute(f) for f in files]


def quantize_torch(module: torch.nn.Module, example_inputs: Any, calib_data: Any,
                   platform: str | Platform = DEFAULT_PLATFORM, *, opset: int = EXPORT_OPSET,
                   input_names: Sequence[str] | None = None, output_names: Sequence[str] | None = None,
                   dynamic_axes: dict[str, dict[int, str]] | None = None, **settings: Any) -> QuantizedModel:
    """Export `module` (in eval mode) to ONNX with netquant's one torch -> ONNX path
    (netquant.nn.export.torch_to_onnx: torch.onnx's torch.export-based exporter, opset EXPORT_OPSET = 21,
    at least 18), then quantize_onnx it.  Inputs are named `input_names` (default input_0, input_1, ...);
    `dynamic_axes` ({input name: {dim: name}}) makes dims symbolic, keeping their names."""
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    module = module.eval()
    names = list(input_names) if input_names else [f"input_{i}" for i in range(len(args))]
    try:
        proto = torch_to_onnx(module, args, opset=opset, input_names=names, output_names=output_names,
                              dynamic_axes=dynamic_axes, what="quantize_torch")
    except ExportError as err:
        raise ModelError(f"torch.onnx.export of {type(module).__name__} failed: {err}") from err
    return quantize_onnx(proto, calib_data, platform, **settings)
