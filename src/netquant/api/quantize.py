"""quantize_onnx / quantize_torch: the PTQ entry points."""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import torch

from netquant.api.float_result import FloatPolicy
from netquant.api.model import QuantizedModel
from netquant.data.calib import PATH_OPTION_KEYS, calibration_files, graph_inputs, load_path_calibration
from netquant.errors import ConfigError, ExportError, ModelError, UnsupportedOpError
from netquant.graph import Graph, load_onnx, to_onnx
from netquant.graph.checker import check_structure
from netquant.nn.export import EXPORT_OPSET, torch_to_onnx
from netquant.outputs import absolute
from netquant.passes.base import PassBase
from netquant.passes.distributed import current_shard
from netquant.passes.progress import make_progress
from netquant.passes.ptq import run_ptq
from netquant.passes.quant_graph import QuantizedGraph
from netquant.passes.settings import Objective, QuantSettings
from netquant.platforms import Platform
from netquant.platforms.heap import long_lived_frozen
from netquant.platforms.platform import Validation
from netquant.platforms.threads import thread_scope

DEFAULT_PLATFORM = "onnxruntime_int8"


class ModelCheckWarning(UserWarning):
    """The input model fails onnx.checker (a warning: onnxruntime and netquant may still run it; exports are checked)."""


def _warn_if_unchecked(model: onnx.ModelProto, source: str) -> None:
    """onnx.checker on the input's structure is advice, not a gate: models ORT runs load (the export stays checked).
    graph.checker.check_structure: the weights' payloads are not serialized again (the loader read them)."""
    try:
        check_structure(model)
    except Exception as exc:  # noqa: BLE001 - checker failures of any kind are reported, not raised
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        warnings.warn(ModelCheckWarning(f"{source}: onnx.checker reports '{first}'; quantizing anyway (the exported "
                                        "model is checked)"), stacklevel=3)


def _load(model: str | os.PathLike[str] | bytes | onnx.ModelProto | Graph) -> tuple[Graph, str, onnx.ModelProto | None]:
    """(graph, where it came from, the ModelProto the loader read: None for a Graph)."""
    read: list[onnx.ModelProto] = []
    graph, source = _load_graph(model, read.append)
    if read:  # (a Graph given: no ONNX file to advise on)
        _warn_if_unchecked(read[0], source)
    return graph, source, read[0] if read else None


def _load_graph(model: str | os.PathLike[str] | bytes | onnx.ModelProto | Graph,
                on_proto: Callable[[onnx.ModelProto], None] | None = None) -> tuple[Graph, str]:
    """The graph to quantize; inputs naming an initializer are plain initializers (constants, as onnxruntime runs them
    when not fed), so calibration and the exported file agree. on_proto: see graph.load.load_onnx."""
    if isinstance(model, Graph):
        graph = model.copy()
        graph.initializer_inputs = []
        return graph, model.name
    if isinstance(model, onnx.ModelProto):
        return load_onnx(model, overridable_inputs=False, on_proto=on_proto), model.graph.name
    if isinstance(model, bytes):
        graph = load_onnx(model, overridable_inputs=False, on_proto=on_proto)
        return graph, graph.name
    if isinstance(model, (str, os.PathLike)):
        path = Path(model)
        if not path.exists():
            raise ModelError(f"model file '{path}' does not exist")
        return load_onnx(str(path), overridable_inputs=False, on_proto=on_proto), str(path)
    raise ModelError(f"model must be a path, serialized ONNX bytes, an onnx.ModelProto or a netquant Graph, got "
                     f"{type(model).__name__}")


def _source_onnx(graph: Graph, required: bool, read: onnx.ModelProto | None = None) -> onnx.ModelProto | None:
    """The loaded model as ONNX (placement's speed floor, export's FP32 reference): the ModelProto the loader read
    where there is one (the user's model itself, not modified; BERT-base: no second 440 MB conversion), else the
    graph written as ONNX; None where it cannot be written and placement does not need it (export then compares with
    the cleaned-up graph)."""
    if read is not None:
        return read
    if required:
        return to_onnx(graph, check=False)
    try:
        return to_onnx(graph, check=False)
    except Exception:  # noqa: BLE001 - the reference falls back to the cleaned-up graph
        return None


_HALF = (torch.float16, torch.bfloat16)


_WEIGHT_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "ConvInteger", "MatMulInteger")


def _check_weights(graph: Graph, source: str) -> None:
    """ModelError up front, naming the initializer and its readers: a float initializer holding NaN (no scale
    quantizes it and it makes NaN outputs; Inf is left alone: masks and Clip bounds hold it on purpose), or an empty
    weight (no elements) of a Conv / MatMul / Gemm (nothing to calibrate or compute)."""
    def where(name: str) -> str:
        named = ", ".join([f"'{n.name}' ({n.op_type})" for n in graph.nodes if name in n.inputs][:3])
        return f"{source}: initializer '{name}'" + (f" (read by {named})" if named else "")

    for name, t in graph.initializers.items():
        if t.is_floating_point() and t.numel() and bool(torch.isnan(t).any()):
            raise ModelError(f"{where(name)} holds {int(torch.isnan(t).sum())} NaN value(s) of {t.numel()}: NaN "
                             "weights cannot be quantized and make NaN outputs; fix the weights (or re-export the "
                             "trained model) first")
    empty = {name for name, t in graph.initializers.items() if t.numel() == 0}
    for n in graph.nodes:
        if n.op_type in _WEIGHT_OPS and len(n.inputs) > 1 and n.inputs[1] in empty:
            t = graph.initializers[n.inputs[1]]
            raise ModelError(f"{where(n.inputs[1])} is an empty weight (shape {list(t.shape)}): the op has nothing "
                             "to compute or quantize; remove it from the model (or re-export the model without it)")


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
                  threads: int | str | None = None, **settings: Any) -> QuantizedModel:
    """Quantize an ONNX model for `platform` after calibrating on `calib_data`.

    passes: your own netquant.passes.PassBase instances, added to the default passes where each one's `stage` says
    (netquant.passes.Stage; in order within a stage): QUANTIZED (default) after bias quantization and correction,
    before the final deployability check (so they see calibrated params); GRAPH before configs are built (graph
    rewrites such as passes.smoothquant.SmoothQuantPass, passes.equalization.EqualizationPass); WEIGHTS once weight
    scales are final, before bias correction (passes.adaround.AdaRoundPass).
    calib_data: batches (arrays, dicts of arrays, an iterable of them), or a path: a folder of images, .npy / .npz
    file(s), or 'random' (a smoke test), read with the CLI's options as keywords: height, width, mean, std,
    channel_order ('rgb' | 'bgr'), layout ('nchw' | 'nhwc'), keep_aspect, num_calib, seed.
    settings: see netquant.passes.QuantSettings (activation_observer, weight_observer, per_channel,
    force_fp32, overrides, strict, quiet, batch_size, max_calib_batches, ...; placement: objective=
    "latency" | "balanced" (default) | "accuracy" | None, max_loss, metric + eval_data (+ higher_is_better=False
    for an error metric), placement_from, effort="fast" | "default" | "max" (the repairs placement tries before it
    floats regions: netquant.analysis.placement.repair);
    see netquant.analysis.placement; min_cosine: the lowest output cosine vs FP32 an export may have in its engine
    (export.fidelity); allow_float / min_int8_fraction: see api.float_result).
    The model's exports raise FloatResultError when no region runs in INT8 (or fewer than min_int8_fraction), unless
    allow_float=True or objective='latency'.
    distributed=True (under torchrun, or with a torch.distributed group): every rank passes the same calib_data and
    calibrates its share; observers merge exactly (scales bit-identical to one process); rank 0 places, and only
    its QuantizedModel.export writes files (QuantizedModel.rank).
    threads: torch's intra-op threads (and onnxruntime's, in the sessions netquant creates) during the run: a count,
    or None / 'auto' for platforms.threads' policy (the CPUs this process may use less those other work keeps
    busy; OMP_NUM_THREADS set: kept). The caller's torch.get_num_threads() is restored after.
    """
    if torch.is_inference_mode_enabled():  # tensors made under inference_mode have no version counter to track
        with torch.inference_mode(False):
            return quantize_onnx(model, calib_data, platform, passes=passes, threads=threads, **settings)
    with thread_scope(threads) as n, long_lived_frozen():
        qmodel = _quantize_onnx(model, calib_data, platform, passes, settings)
    qmodel.threads = n
    return qmodel


def _quantize_onnx(model: str | os.PathLike[str] | bytes | onnx.ModelProto | Graph, calib_data: Any,
                   platform: str | Platform, passes: Sequence[PassBase], settings: dict[str, Any]) -> QuantizedModel:
    t0 = time.perf_counter()
    path_options = {k: settings.pop(k) for k in PATH_OPTION_KEYS if k in settings}
    s = QuantSettings.from_kwargs(platform, settings)
    rank = current_shard().rank if s.distributed else 0
    if rank != 0:  # rank 0 places and writes; the others only calibrate their share
        s = dataclasses.replace(s, objective=None, placement_from=None)
    graph, source, read = _load(model)
    _check_float32(graph, source)
    _check_weights(graph, source)
    read_files = _read_files(model, graph, calib_data, s)  # before a calibration path becomes batches
    if isinstance(calib_data, (str, os.PathLike)):  # an image folder, .npy / .npz file(s) or 'random', as the CLI's
        calib_data = load_path_calibration(calib_data, graph_inputs(graph), s.batch_size, **path_options)
    elif path_options:
        raise ConfigError(f"{', '.join(sorted(path_options))}: these options say how files become calibration data; "
                          "give calib_data as a folder of images, an .npy / .npz path or 'random'")
    timed = s.objective is not None and s.placement_from is None and s.platform.validation is Validation.ONNXRUNTIME
    # the user's FP32 model: the speed placement must not fall below, and export's FP32 reference (export.fidelity)
    source_model = _source_onnx(graph, required=timed, read=read)
    # the platform's wider format (Platform.wider): placement calibrates the same model in it when first needed
    widens = s.platform.wider is not None and (s.objective is not None or s.placement_from is not None)
    twin_graph = copy.deepcopy(graph) if widens and isinstance(model, Graph) else None
    run = run_ptq(graph, calib_data, s, extra_passes=passes)  # validates calib_data (CheckDataPass), once
    timings = dict(run.timings)
    from netquant.analysis.placement import applies, place_with_repair
    from netquant.analysis.placement.measure import whole_model_timing

    requantize = None
    given = tuple(p.name for p in passes)
    if (s.objective is not None or s.placement_from is not None) and run.calib_data is not None and \
            run.calib_data.num_batches is not None:  # not a one-shot stream: it can calibrate again
        def requantize(extra: Sequence[PassBase], overrides: Mapping[str, Any]) -> QuantizedGraph:
            """The model quantized again with a repair (analysis.placement.repair), placement left to the caller."""
            again = dataclasses.replace(s, objective=None, placement_from=None, quiet=True, distributed=False,
                                        **overrides)
            fresh = copy.deepcopy(model) if isinstance(model, Graph) else model
            qgraph = run_ptq(_load_graph(fresh)[0], calib_data, again, extra_passes=[*passes, *extra]).qgraph
            qgraph.fp32_source = source_model
            return qgraph

    wide = None
    if widens and run.calib_data is not None and run.calib_data.num_batches is not None:
        wide_settings = dataclasses.replace(s, platform=s.platform.widened(), objective=None, placement_from=None,
                                            quiet=True, distributed=False)  # rank 0 alone

        def wide() -> QuantizedGraph:
            twin = twin_graph if twin_graph is not None else _load(model)[0]
            return run_ptq(twin, calib_data, wide_settings, extra_passes=passes).qgraph

    t1 = time.perf_counter()
    run.qgraph.fp32_source = source_model
    with make_progress(s.quiet or not applies(s, run.qgraph)) as progress, progress.stage(
            "placement: INT8 or float per region" if s.placement_from is None else "placement: re-applying the file"):
        # objective / placement_from: measured INT8-or-float per region
        placement, run.qgraph = place_with_repair(run.qgraph, s, elapsed_s=t1 - t0, source=source_model if timed
                                                  else None, wide=wide, requantize=requantize, given=given)
    if placement is not None:
        timings["placement"] = time.perf_counter() - t1
        run.qgraph.whole_model_timing = whole_model_timing(placement, run.qgraph)
        if timed and "timed_shapes" in placement.measured:  # export.fidelity times at placement's shapes
            run.qgraph.timed_shapes = {k: tuple(int(d) for d in v)
                                       for k, v in placement.measured["timed_shapes"].items()}
    timings["total"] = time.perf_counter() - t0
    # the validated data is kept for reports (layer_report's default), unless it was a one-shot stream
    kept = run.calib_data if run.calib_data is not None and run.calib_data.num_batches is not None else None
    policy = FloatPolicy(s.allow_float or s.objective is Objective.LATENCY, s.min_int8_fraction)
    qmodel = QuantizedModel(run.qgraph, source, timings, kept, placement, min_cosine=s.min_cosine, float_policy=policy,
                            inputs=read_files)
    qmodel.progress = not s.quiet  # exports show progress as the passes and placement did
    qmodel.rank = rank
    return qmodel


def _read_files(model: Any, graph: Graph, calib_data: Any, s: QuantSettings) -> list[Path]:
    """The files this run read (absolute: the user may chdir before exporting): the model and its external
    data (as the loader read them: the model is not parsed again), a calibration file or folder given by path, the
    placement file."""
    files = [Path(model), *map(Path, graph.model_info.data_files)] if isinstance(model, (str, os.PathLike)) else []
    if isinstance(calib_data, (str, os.PathLike)):
        files += calibration_files(calib_data)
    if s.placement_from is not None:
        files.append(Path(s.placement_from))
    return [absolute(f) for f in files]


def quantize_torch(module: torch.nn.Module, example_inputs: Any, calib_data: Any,
                   platform: str | Platform = DEFAULT_PLATFORM, *, opset: int = EXPORT_OPSET,
                   input_names: Sequence[str] | None = None, output_names: Sequence[str] | None = None,
                   dynamic_axes: dict[str, dict[int, str]] | None = None, dynamic_batch: bool = True,
                   threads: int | str | None = None, **settings: Any) -> QuantizedModel:
    """Export `module` (in eval mode) to ONNX with netquant's one torch -> ONNX path
    (netquant.nn.export.torch_to_onnx: torch.onnx's torch.export-based exporter, opset EXPORT_OPSET = 21,
    at least 18), then quantize_onnx it.  Inputs are named `input_names` (default input_0, input_1, ...).
    Dim 0 of every tensor input is symbolic by default (dynamic_batch: calibration batches and the exported file take
    any batch size, whatever the example's); `dynamic_axes` ({input name: {dim: name}}) picks the symbolic dims
    instead, keeping their names; dynamic_batch=False with no dynamic_axes fixes every dim to the example's.
    Weight-only int4 / int8 (MatMulNBits or blocked DQ files) of a module: netquant.quantize_weights(module, path,
    example_inputs=...); a module quantized with netquant.nn: netquant.export_weight_only.
    Keyword inputs: example_inputs as a dict {name: tensor} (e.g. a Hugging Face tokenizer's output for a
    transformers AutoModel: input_ids / attention_mask / token_type_ids) calls forward(**example); the inputs keep
    their names, dims 0 (batch) and, for token inputs, 1 (sequence) are symbolic by default, and a ModelOutput's
    fields name the outputs (netquant.api.keyword_inputs; transformers models need no wrapper).
    The caller's module keeps its train / eval modes (it is exported in eval mode). `threads` as in quantize_onnx
    (the export runs under it too)."""
    _check_float_module(module)
    with thread_scope(threads) as n:
        return _quantize_torch(module, example_inputs, calib_data, platform, opset, input_names, output_names,
                               dynamic_axes, dynamic_batch, n, settings)


def _quantize_torch(module: torch.nn.Module, example_inputs: Any, calib_data: Any, platform: str | Platform,
                    opset: int, input_names: Sequence[str] | None, output_names: Sequence[str] | None,
                    dynamic_axes: dict[str, dict[int, str]] | None, dynamic_batch: bool, threads: int,
                    settings: dict[str, Any]) -> QuantizedModel:
    modes = [(m, m.training) for m in module.modules()]  # the caller's train / eval mode, given back after export
    try:
        with torch.inference_mode(False):  # (under inference_mode the graph's tensors could not be versioned)
            module.eval()
            if isinstance(example_inputs, Mapping):  # keyword inputs (a tokenizer's output): api.keyword_inputs
                proto = _export_keywords(module, example_inputs, opset, output_names, dynamic_axes, dynamic_batch)
            else:
                args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
                names = list(input_names) if input_names else [f"input_{i}" for i in range(len(args))]
                proto = torch_to_onnx(module, args, opset=opset, input_names=names, output_names=output_names,
                                      dynamic_axes=dynamic_axes, dynamic_batch=dynamic_batch, what="quantize_torch")
    except ExportError as err:
        raise ModelError(f"torch.onnx.export of {type(module).__name__} failed: {err}") from err
    finally:
        for m, training in modes:
            m.training = training
    return quantize_onnx(proto, calib_data, platform, threads=threads, **settings)


def _export_keywords(module: torch.nn.Module, example: Mapping[str, Any], opset: int,
                     output_names: Sequence[str] | None, dynamic_axes: dict[str, dict[int, str]] | None,
                     dynamic_batch: bool) -> onnx.ModelProto:
    from netquant.api.keyword_inputs import keyword_export, name_dims

    plan = keyword_export(module, example, output_names=output_names, dynamic_axes=dynamic_axes,
                          dynamic_batch=dynamic_batch)
    proto = torch_to_onnx(module, (), kwargs=plan.kwargs, opset=opset, input_names=plan.input_names,
                          output_names=plan.output_names, dynamic_shapes=plan.dynamic_shapes, what="quantize_torch")
    name_dims(proto, plan.dim_names)
    return proto


def _check_float_module(module: Any) -> None:
    """ModelError before exporting: not a module, weights on the 'meta' device (no values), or already quantized by
    netquant.nn (its quantizers would be exported as data-dependent code)."""
    from netquant.nn.quantizer import TensorQuantizer

    if not isinstance(module, torch.nn.Module):
        raise ModelError(f"quantize_torch takes a torch.nn.Module, got {type(module).__name__}")
    what = type(module).__name__
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if t.is_meta:
            raise ModelError(f"quantize_torch: {what} has tensor '{name}' on the 'meta' device (a shape without "
                             "values, e.g. built under torch.device('meta')); load its weights first, e.g. "
                             "module.to_empty(device='cpu') then module.load_state_dict(...)")
    for name, m in module.named_modules():
        if isinstance(m, TensorQuantizer):
            raise ModelError(f"quantize_torch: {what} is already quantized by netquant.nn (quantize_model): "
                             f"'{name or what}' is a {type(m).__name__}; give quantize_torch the float module, or "
                             "calibrate this one and write it with netquant.nn.export_onnx(module, example, path)")
