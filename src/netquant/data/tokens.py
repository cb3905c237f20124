"""Calibration text for decoder LLMs: token ids from `.npy` / `.npz` or a text file with a tokenizer folder, cut into
windows and turned into the feeds a decoder ONNX graph takes (input_ids, attention_mask, position_ids, empty KV cache).

Token arrays: a 1-D stream (cut into `seq_len` windows) or a 2-D [samples, seq] array (rows taken as they are).
Text: `tokenizer.json` in the tokenizer folder, read with the `tokenizers` package (`pip install -e '.[llm]'`).
A KV-cache input (name containing 'past' or 'cache') gets a zero tensor with 0 past positions; GroupQueryAttention
graphs' seqlens_k / total_sequence_length get seq - 1 and seq.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx

from netquant.errors import ConfigError, DataError

Feeds = dict[str, np.ndarray]


def load_token_windows(path: str | os.PathLike[str], seq_len: int = 128, count: int = 32,
                       tokenizer: str | os.PathLike[str] | None = None) -> np.ndarray:
    """[n, seq_len] int64 windows (n <= count) from a token file or a text file (module docstring)."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"calibration text '{p}' does not exist")
    if p.suffix in (".npy", ".npz"):
        try:
            data = np.load(p)
            ids = data[data.files[0]] if isinstance(data, np.lib.npyio.NpzFile) else data
        except Exception as exc:
            raise DataError(f"calibration tokens '{p}' cannot be read ({type(exc).__name__}: {exc})") from exc
        if not np.issubdtype(ids.dtype, np.integer):
            raise DataError(f"calibration tokens '{p}' hold {ids.dtype}, not integer token ids")
    else:
        ids = np.asarray(_tokenize(p, tokenizer), dtype=np.int64)
    if ids.ndim == 2:
        windows = ids[:count, :seq_len]
    elif ids.ndim == 1:
        n = min(count, len(ids) // seq_len)
        if n == 0:
            raise DataError(f"calibration text '{p}' has {len(ids)} tokens, fewer than one window of {seq_len}; give "
                            "more text or a smaller --seq-len")
        windows = ids[: n * seq_len].reshape(n, seq_len)
    else:
        raise DataError(f"calibration tokens '{p}' have shape {ids.shape}; give a 1-D stream or [samples, seq]")
    if windows.size == 0 or (windows < 0).any():
        raise DataError(f"calibration tokens '{p}' are empty or negative")
    return windows.astype(np.int64)


def _tokenize(path: Path, tokenizer: str | os.PathLike[str] | None) -> list[int]:
    if tokenizer is None:
        raise ConfigError(f"calibration text '{path}' needs a tokenizer: give --tokenizer FOLDER (with tokenizer.json), "
                          "or token ids as .npy")
    file = Path(tokenizer) / "tokenizer.json" if Path(tokenizer).is_dir() else Path(tokenizer)
    if not file.is_file():
        raise ConfigError(f"tokenizer '{tokenizer}' has no tokenizer.json")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError("reading text needs the 'tokenizers' package: pip install -e '.[llm]' (or give token ids "
                          "as .npy)") from None
    text = path.read_text(encoding="utf-8", errors="replace")
    return Tokenizer.from_file(str(file)).encode(text).ids


def _past_shape(info: onnx.ValueInfoProto) -> list[int]:
    dims = []
    for i, d in enumerate(info.type.tensor_type.shape.dim):
        if d.HasField("dim_value"):
            dims.append(d.dim_value)
        elif i == 0:
            dims.append(1)
        else:
            dims.append(0)  # the past-sequence dimension (the only other symbolic one in a KV-cache input)
    return dims


def decoder_feeds(model: onnx.ModelProto, windows: np.ndarray) -> list[Feeds]:
    """One feed dict per window [seq] for the decoder graph `model` (module docstring)."""
    inputs = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
    feeds: list[Feeds] = []
    for window in windows:
        seq = len(window)
        feed: Feeds = {}
        for info in inputs:
            name = info.name
            elem = info.type.tensor_type.elem_type
            dtype = onnx.helper.tensor_dtype_to_np_dtype(elem) if elem else np.float32
            lower = name.lower()
            if "input_ids" in lower or lower in ("ids", "tokens"):
                feed[name] = window.reshape(1, seq).astype(dtype)
            elif "attention_mask" in lower:
                feed[name] = np.ones((1, seq), dtype=dtype)
            elif "position_ids" in lower:
                feed[name] = np.arange(seq, dtype=dtype).reshape(1, seq)
            elif lower == "seqlens_k":
                feed[name] = np.full((1,), seq - 1, dtype=dtype)
            elif lower == "total_sequence_length":
                feed[name] = np.array(seq, dtype=dtype)
            elif "past" in lower or "cache" in lower:
                feed[name] = np.zeros(_past_shape(info), dtype=dtype)
            else:
                raise DataError(f"decoder input '{name}' is not input_ids / attention_mask / position_ids / a KV "
                                "cache; give calibration feeds yourself (Python: feeds=[{...}])")
        feeds.append(feed)
    return feeds


def vocabulary_size(model: onnx.ModelProto, default: int = 32000) -> int:
    """Rows of the Gather table that input_ids index (the embedding), else `default`."""
    shapes = {t.name: list(t.dims) for t in model.graph.initializer}
    ids = {i.name for i in model.graph.input if "input_ids" in i.name.lower()}
    return next((shapes[n.input[0]][0] for n in model.graph.node
                 if n.op_type == "Gather" and len(n.input) > 1 and n.input[1] in ids
                 and len(shapes.get(n.input[0], [])) == 2), default)


def random_windows(model_path: str | os.PathLike[str], count: int, seq_len: int, seed: int = 0) -> np.ndarray:
    """Random token ids below the vocabulary size."""
    vocab = vocabulary_size(onnx.load_model(str(model_path), load_external_data=False))
    return np.random.default_rng(seed).integers(0, vocab, size=(count, seq_len), dtype=np.int64)


def validation_feeds(model: onnx.ModelProto, seq_len: int = 16, seed: int = 0) -> list[Feeds]:
    """Feeds to check a file runs when no calibration data was given: a decoder's inputs from random token ids below the
    vocabulary, else random normal floats / zero ints with symbolic dims set to 1 (named KV-cache dims to 0)."""
    init_names = {t.name for t in model.graph.initializer}
    windows = np.random.default_rng(seed).integers(0, vocabulary_size(model), size=(1, seq_len), dtype=np.int64)
    try:
        return decoder_feeds(model, windows)
    except DataError:
        pass
    rng = np.random.default_rng(seed)
    feed: Feeds = {}
    for info in model.graph.input:
        if info.name in init_names:
            continue
        elem = info.type.tensor_type.elem_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(elem) if elem else np.float32
        dims = [d.dim_value if d.HasField("dim_value") else (0 if "past" in d.dim_param else 1)
                for d in info.type.tensor_type.shape.dim]
        feed[info.name] = rng.standard_normal(dims).astype(dtype) if np.issubdtype(dtype, np.floating) else \
            np.zeros(dims, dtype=dtype)
    return [feed]
