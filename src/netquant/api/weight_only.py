"""`netquant.quantize_weights`: weight-only int4 / int8 of an ONNX model's MatMul / Gemm weights (thin entry point;
the flow is `passes.weight_only`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

import numpy as np
import onnx

from netquant.data.tokens import decoder_feeds, load_token_windows
from netquant.errors import ConfigError
from netquant.export.weight_only import WeightOnlyFormat
from netquant.passes.weight_only import (
    WeightAlgorithm,
    WeightOnlyConfig,
    WeightOnlyResult,
    quantize_weights_onnx,
)


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
