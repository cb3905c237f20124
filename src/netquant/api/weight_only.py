"""`netquant.quantize_weights`: weight-only int4 / int8 of an ONNX model's (or a PyTorch module's) MatMul / Gemm
weights, and `export_weight_only`: a quantized module (netquant.nn, e.g. the w4a16 preset or after QAT) written with its
weights as MatMulNBits or integer DQ. Thin entry points: codes from `passes.weight_only`, the mixed int4 / int8 choice
from `analysis.weight_only_mixed`, the file from `export.weight_only`."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch

from netquant.analysis.weight_only_mixed import MixedSearch, search_mixed_bits
from netquant.atomic import atomic_path
from netquant.core.blockwise import WeightOnlyFormat
from netquant.data.tokens import decoder_feeds, load_token_windows
from netquant.errors import ConfigError, DataError, ExportError
from netquant.export.opset import upgrade_opset
from netquant.export.weight_only import dq_weights_to_matmulnbits, model_bytes, rewrite_all, write_weight_only
from netquant.nn.export import EXPORT_OPSET, export_onnx, torch_to_onnx
from netquant.passes.weight_only import (
    LayerRecord,
    WeightAlgorithm,
    WeightOnlyConfig,
    load_weightless,
    plan_weight_only,
)
from netquant.platforms.threads import thread_scope

Feeds = dict[str, np.ndarray]
_PROTO_LIMIT = 1_800_000_000  # bytes: a larger exported module is saved with external data


@dataclass
class WeightOnlyResult:
    """What was written: files, per-layer records, excluded nodes, onnxruntime's output cosine vs FP32 per output,
    sizes, time, and the mixed int4 / int8 search when a budget was given."""

    path: Path
    files: list[Path]
    layers: list[LayerRecord]
    skipped: list[str]
    cosine: dict[str, float] = field(default_factory=dict)
    source_bytes: int = 0
    output_bytes: int = 0
    seconds: float = 0.0
    mixed: MixedSearch | None = None


def quantize_weights_onnx(model_path: str | os.PathLike[str], output: str | os.PathLike[str],
                          config: WeightOnlyConfig, feeds: Sequence[Feeds] = (),
                          progress: Callable[[str], None] | None = None,
                          threads: int | str | None = "auto") -> WeightOnlyResult:
    """Weight-only quantize `model_path` into `output` (+ `output.data`), validated in onnxruntime. `feeds`: calibration
    inputs by name (needed by AWQ / GPTQ and max_loss; without them the file is checked on random inputs). `threads`:
    torch and onnxruntime intra-op threads of the run (platforms.threads: 'auto' leaves out the CPUs other work keeps
    busy; the block math on a busy machine is many times slower with more threads than free CPUs)."""
    with thread_scope(threads):
        return _quantize_weights_onnx(model_path, output, config, feeds, progress)


def _quantize_weights_onnx(model_path: str | os.PathLike[str], output: str | os.PathLike[str],
                           config: WeightOnlyConfig, feeds: Sequence[Feeds],
                           progress: Callable[[str], None] | None) -> WeightOnlyResult:
    start = time.perf_counter()
    out = Path(output).resolve()
    model, src = load_weightless(model_path, [out, out.with_name(out.name + ".data")])
    if config.fmt is WeightOnlyFormat.BLOCKED_DQ:
        model = upgrade_opset(model, 21)
    plan = plan_weight_only(model, src, config, feeds, progress)
    mixed = search_mixed_bits(plan, config, progress) if config.max_loss is not None else None
    rewrite_all(plan.model, plan.targets, plan.codes, config.fmt, config.accuracy_level, plan.embeddings,
                config.wide_level)
    files, cosine = write_weight_only(plan.model, out, plan.reader, config.fmt, plan.feeds[: len(plan.reference)],
                                      plan.reference)
    return WeightOnlyResult(out, files, plan.records, plan.skipped, cosine, model_bytes(src),
                            sum(f.stat().st_size for f in files), time.perf_counter() - start, mixed)


def _enum(cls: type, value: object, option: str) -> object:
    if isinstance(value, cls):
        return value
    try:
        return cls(str(value).lower())
    except ValueError:
        choices = ", ".join(m.value for m in cls)  # type: ignore[attr-defined]
        raise ConfigError(f"{option}={value!r}: choose one of {choices}") from None


def _args(example_inputs: Any) -> tuple[Any, ...]:
    return example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)


def _numpy(x: Any, what: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    if isinstance(x, np.ndarray):
        return x
    raise DataError(f"{what}: expected a tensor or numpy array, got {type(x).__name__}")


def module_feeds(batches: Iterable[Any], names: Sequence[str], example: Sequence[Any]) -> list[Feeds]:
    """Batches for a module (a tensor, a tuple of tensors in input order, or a dict by input name) as ONNX feeds; each
    input must have the example's shape but for dim 0 (the one dynamic dim of the export)."""
    shapes = {n: tuple(np.shape(_numpy(e, "example input"))) for n, e in zip(names, example, strict=False)}
    feeds = []
    for i, batch in enumerate(batches):
        what = f"calibration batch {i}"
        if isinstance(batch, Mapping):
            feed = {str(k): _numpy(v, what) for k, v in batch.items()}
        else:
            values = batch if isinstance(batch, (tuple, list)) else (batch,)
            if len(values) != len(names):
                raise DataError(f"{what} holds {len(values)} tensor(s), the module takes {len(names)} "
                                f"({', '.join(names)}); give one tensor per input")
            feed = {n: _numpy(v, what) for n, v in zip(names, values, strict=True)}
        missing = [n for n in names if n not in feed]
        if missing:
            raise DataError(f"{what} lacks the module inputs {missing}")
        for n in names:
            got, want = feed[n].shape, shapes.get(n)
            if want is not None and (len(got) != len(want) or got[1:] != want[1:]):
                raise DataError(f"{what}: input '{n}' has shape {list(got)}, the module was exported with "
                                f"{list(want)} (only dim 0 may differ); give batches of the example's shape")
        feeds.append({n: feed[n] for n in names})
    return feeds


def quantize_weights(model: str | os.PathLike[str] | torch.nn.Module, output: str | os.PathLike[str], *,
                     bits: int = 4, block_size: int = 128, symmetric: bool = True,
                     algorithm: str | WeightAlgorithm = "rtn", format: str | WeightOnlyFormat = "matmulnbits",
                     act_order: bool = False, exclude: Sequence[str] = (),
                     calib: str | os.PathLike[str] | None = None, tokenizer: str | os.PathLike[str] | None = None,
                     seq_len: int = 128, num_calib: int = 32, feeds: Sequence[Feeds] | None = None,
                     example_inputs: Any = None, calib_data: Iterable[Any] | None = None,
                     input_names: Sequence[str] | None = None, opset: int = EXPORT_OPSET,
                     max_loss: float | None = None, accuracy_level: int = 0, embeddings: bool = True,
                     head_bits: int | None = 8, progress: Callable[[str], None] | None = None) -> WeightOnlyResult:
    """Weight-only quantize `model` into `output` (+ `output.data`).

    `model`: an ONNX file, or a float torch.nn.Module exported first with netquant's torch -> ONNX path
    (`example_inputs`: a tensor or tuple; inputs named `input_names`, default input_0, input_1, ...; dim 0 dynamic),
    its Linear layers written as MatMulNBits or blocked int4 / int8 DQ. `calib_data` (modules): batches (a tensor,
    a tuple or a dict by input name) for AWQ / GPTQ and validation; the example is the validation batch without it.
    `calib`: token ids (.npy / .npz) or a text file with `tokenizer` (a folder with tokenizer.json), cut into
    `num_calib` windows of `seq_len` tokens and fed as a decoder's inputs; or give `feeds` directly. Data-aware
    algorithms (awq, gptq) need one of them; every algorithm uses them to validate the file against FP32.
    `max_loss` (bits=4): the most sensitive layers go to int8 until 1 - output cosine vs FP32 is within it.
    `embeddings`: the token-embedding Gather tables too (rows in blocks: GatherBlockQuantized or DQ + Gather).
    `head_bits` (bits=4): the output layer (lm_head: the MatMul writing a graph output, else the last one) and the
    embedding tables at 8 bits (NNCF's default backup precision), or 4 / None like the other layers.
    `accuracy_level` 4 lets onnxruntime's MatMulNBits quantize activations to int8 (faster on CPUs; validated too).
    """
    config = WeightOnlyConfig(bits, block_size, symmetric, _enum(WeightAlgorithm, algorithm, "algorithm"),  # type: ignore[arg-type]
                              _enum(WeightOnlyFormat, format, "format"), act_order, tuple(exclude),  # type: ignore[arg-type]
                              max_loss, accuracy_level, embeddings, head_bits)
    if isinstance(model, torch.nn.Module):
        return _quantize_module_weights(model, output, config, example_inputs, calib_data, feeds, input_names, opset,
                                        progress)
    if feeds is None and calib is not None:
        windows = load_token_windows(calib, seq_len, num_calib, tokenizer)
        feeds = decoder_feeds(onnx.load_model(str(model), load_external_data=False), windows)
    return quantize_weights_onnx(model, output, config, list(feeds or []), progress)


def _quantize_module_weights(module: torch.nn.Module, output: str | os.PathLike[str], config: WeightOnlyConfig,
                             example_inputs: Any, calib_data: Iterable[Any] | None, feeds: Sequence[Feeds] | None,
                             input_names: Sequence[str] | None, opset: int,
                             progress: Callable[[str], None] | None) -> WeightOnlyResult:
    """The module exported in float (a hidden folder beside `output`, removed afterwards), then weight-only quantized."""
    if example_inputs is None:
        raise ConfigError(f"quantize_weights of a {type(module).__name__}: give example_inputs (a tensor or a tuple "
                          "of tensors the module takes) to export it")
    args = _args(example_inputs)
    names = list(input_names) if input_names else [f"input_{i}" for i in range(len(args))]
    module = module.eval()
    proto = torch_to_onnx(module, args, opset=opset, input_names=names, dynamic_batch=True, what="quantize_weights")
    if feeds is None:
        feeds = module_feeds(calib_data if calib_data is not None else [args], names, args)
    out = Path(output)
    if not out.parent.is_dir():
        raise ExportError(f"cannot write '{out}': folder '{out.parent}' does not exist")
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.float.", dir=out.parent))
    try:
        source = stage / "float.onnx"
        big = proto.ByteSize() > _PROTO_LIMIT
        onnx.save_model(proto, str(source), save_as_external_data=big, location="float.onnx.data")
        del proto
        return quantize_weights_onnx(source, out, config, list(feeds), progress)
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def export_weight_only(module: torch.nn.Module, example_inputs: Any, path: str | os.PathLike[str], *,
                       format: str | WeightOnlyFormat = "matmulnbits", opset: int = EXPORT_OPSET,
                       input_names: Sequence[str] | None = None, output_names: Sequence[str] | None = None,
                       dynamic_batch: bool = True, accuracy_level: int = 0, max_error_ratio: float = 0.02) -> Path:
    """Export a quantized module (netquant.nn; e.g. ModelQuantConfig.w4a16()) with integer weights; returns `path`.

    format "dq": `nn.export_onnx`'s file (integer initializers -> DequantizeLinear, blocked for per-group specs).
    format "matmulnbits": its blocked int4 / int8 DQ -> MatMul / Gemm weights rewritten as com.microsoft.MatMulNBits
    (onnxruntime's weight-only kernel; netquant.export.weight_only.dq_weights_to_matmulnbits); other weights stay DQ.
    `accuracy_level` (MatMulNBits): 0 computes with the dequantized float weights (the module's numbers), 4 quantizes
    activations to int8 per block (onnxruntime's faster integer kernel, and what it picks when it fuses DQ -> MatMul).
    Validated before it is written: onnxruntime runs the file on `example_inputs` and every output must be within
    `max_error_ratio` x max |output| of the module's fake-quant forward (ExportError otherwise, nothing written).
    """
    fmt = _enum(WeightOnlyFormat, format, "format")
    if accuracy_level not in (0, 1, 2, 3, 4):
        raise ConfigError(f"accuracy_level={accuracy_level}: use 0 (float compute) .. 4 (int8 activations)")
    target = Path(path)
    args = _args(example_inputs)
    with atomic_path(target, "ONNX model") as tmp:
        export_onnx(module, args, tmp, opset=opset, input_names=input_names, output_names=output_names,
                    dynamic_batch=dynamic_batch)
        if fmt is WeightOnlyFormat.MATMUL_NBITS:
            proto = onnx.load_model(str(tmp))
            if dq_weights_to_matmulnbits(proto, accuracy_level):
                onnx.save_model(proto, str(tmp))
        _check_against_module(tmp, module, args, max_error_ratio, target)
    return target


def _check_against_module(path: Path, module: torch.nn.Module, args: tuple[Any, ...], max_error_ratio: float,
                          target: Path) -> None:
    import onnxruntime as ort

    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            ref = module(*args)
    finally:
        module.train(was_training)
    refs = [ref] if isinstance(ref, torch.Tensor) else list(ref)
    try:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        feeds = {i.name: _numpy(a, "example input") for i, a in zip(session.get_inputs(), args, strict=False)}
        got = session.run(None, feeds)
    except Exception as exc:
        raise ExportError(f"'{target}': onnxruntime cannot run the exported file, nothing written: "
                          f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from exc
    for i, (g, r) in enumerate(zip(got, refs, strict=False)):
        want = r.detach().cpu().numpy()
        err = float(np.abs(g - want).max()) if want.size else 0.0
        scale = float(np.abs(want).max()) if want.size else 0.0
        if not np.isfinite(g).all() or err > max_error_ratio * max(scale, 1e-12):
            raise ExportError(f"'{target}': output {i} in onnxruntime differs from the module's fake-quant forward by "
                              f"{err:.3g} (max |output| {scale:.3g}, allowed ratio {max_error_ratio}); nothing written. "
                              "Export with format='dq' or report the model")
