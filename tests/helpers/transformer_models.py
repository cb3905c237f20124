"""Small BERT-style encoders (zoo.bert_module, fused QKV Linear, token Embedding, additive mask) for fast tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from netquant.api import zoo

SMALL = {"layers": 2, "dim": 64, "heads": 4, "ff": 128, "vocab": 512}


def small_bert(path: Path, seq: int | None = 32, seed: int = 0) -> Path:
    """A 2-layer, width-64 BERT-style encoder exported with TorchScript at opset 17 (fixed [1, seq], or dynamic
    batch and seq when seq is None) at `path`."""
    zoo.export_bert(zoo.bert_module(**SMALL, seed=seed), path, seq)
    return path


def small_bert_batches(n: int, seq: int = 32, batch: int = 1, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """`n` tokenized batches for small_bert."""
    return [zoo.bert_inputs(batch, seq, seed=seed + i, vocab=SMALL["vocab"]) for i in range(n)]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))
