"""`netquant.quantize_weights`: weight-only int4 / int8 of an ONNX model's MatMul / Gemm weights. Thin entry points:
codes from `passes.weight_only`, the mixed int4 / int8 choice from `analysis.weight_only_mixed`, the file from
`export.weight_only`."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from netquant.analysis.weight_only_mixed import MixedSearch, search_mixed_bits
from netquant.core.blockwise import WeightOnlyFormat
from netquant.data.tokens import decoder_feeds, load_token_windows
from netquant.errors import ConfigError
from netquant.export.opset import upgrade_opset
from netquant.export.weight_only import model_bytes, rewrite_all, write_weight_only
from netquant.passes.weight_only import (
    LayerRecord,
    WeightAlgorithm,
    WeightOnlyConfig,
    load_weightless,
    plan_weight_only,
)

Feeds = dict[str, np.ndarray]


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
                          progress: Callable[[str], None] | None = None) -> WeightOnlyResult:
    """Weight-only quantize `model_path` into `output` (+ `output.data`), validated in onnxruntime. `feeds`: calibration
    inputs by name (needed by AWQ / GPTQ and max_loss; without them the file is checked on random inputs)."""
    start = time.perf_counter()
    out = Path(output).resolve()
    model, src = load_weightless(model_path, [out, out.with_name(out.name + ".data")])
    if config.fmt is WeightOnlyFormat.BLOCKED_DQ:
        model = upgrade_opset(model, 21)
    plan = plan_weight_only(model, src, config, feeds, progress)
    mixed = search_mixed_bits(plan, config, progress) if config.max_loss is not None else None
    rewrite_all(plan.model, plan.targets, plan.codes, config.fmt, config.accuracy_level, plan.embeddings)
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


def quantize_weights(model: str | os.PathLike[str], output: str | os.PathLike[str], *, bits: int = 4,
                     block_size: int = 128, symmetric: bool = True, algorithm: str | WeightAlgorithm = "rtn",
                     format: str | WeightOnlyFormat = "matmulnbits", act_order: bool = False,
                     exclude: Sequence[str] = (), calib: str | os.PathLike[str] | None = None,
                     tokenizer: str | os.PathLike[str] | None = None, seq_len: int = 128, num_calib: int = 32,
                     feeds: Sequence[dict[str, np.ndarray]] | None = None, max_loss: float | None = None,
                     accuracy_level: int = 0, embeddings: bool = False,
                     progress: Callable[[str], None] | None = None) -> WeightOnlyResult:
    """Weight-only quantize `model` into `output` (+ `output.data`).

    `calib`: token ids (.npy / .npz) or a text file with `tokenizer` (a folder with tokenizer.json), cut into
    `num_calib` windows of `seq_len` tokens and fed as a decoder's inputs; or give `feeds` directly. Data-aware
    algorithms (awq, gptq) need one of them; every algorithm uses them to validate the file against FP32.
    `max_loss` (bits=4): the most sensitive layers go to int8 until 1 - output cosine vs FP32 is within it.
    `embeddings`: the token-embedding Gather tables too (rows in blocks: GatherBlockQuantized or DQ + Gather).
    `accuracy_level` 4 lets onnxruntime's MatMulNBits quantize activations to int8 (faster on CPUs; validated too).
    """
    config = WeightOnlyConfig(bits, block_size, symmetric, _enum(WeightAlgorithm, algorithm, "algorithm"),  # type: ignore[arg-type]
                              _enum(WeightOnlyFormat, format, "format"), act_order, tuple(exclude),  # type: ignore[arg-type]
                              max_loss, accuracy_level, embeddings)
    if feeds is None and calib is not None:
        windows = load_token_windows(calib, seq_len, num_calib, tokenizer)
        feeds = decoder_feeds(onnx.load_model(str(model), load_external_data=False), windows)
    return quantize_weights_onnx(model, output, config, list(feeds or []), progress)
