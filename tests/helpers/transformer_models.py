"""Small BERT-style encoders (zoo.bert_module, fused QKV Linear, token Embedding, additive mask) for fast tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from netquant.api import zoo
from tests.helpers.ir import make_model

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


def ort_fused_bert(seed: int = 0, vocab: int = 512, hidden: int = 64, heads: int = 4, ff: int = 128,
                   seq: int | str = "seq") -> onnx.ModelProto:
    """One BERT layer in the form onnxruntime.transformers.optimizer writes: EmbedLayerNormalization -> com.microsoft
    Attention (packed QKV weights [H, 3H]) -> MatMul -> SkipLayerNormalization -> MatMul -> BiasGelu -> MatMul ->
    SkipLayerNormalization; inputs input_ids / attention_mask int32 [batch, seq]."""
    rng = np.random.default_rng(seed)

    def w(name: str, *shape: int, std: float = 0.05) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * std).astype(np.float32), name)

    def ones(name: str, n: int) -> onnx.TensorProto:
        return numpy_helper.from_array((1 + 0.1 * rng.standard_normal(n)).astype(np.float32), name)

    inits = [w("word", vocab, hidden, std=0.5), w("pos", 128, hidden, std=0.5), ones("g0", hidden),
             w("b0", hidden), w("wqkv", hidden, 3 * hidden), w("bqkv", 3 * hidden), w("wo", hidden, hidden),
             w("bo", hidden), ones("g1", hidden), w("b1", hidden), w("w1", hidden, ff), w("bf1", ff),
             w("w2", ff, hidden), w("bf2", hidden), ones("g2", hidden), w("b2", hidden)]
    ms = "com.microsoft"
    nodes = [
        helper.make_node("EmbedLayerNormalization", ["input_ids", "", "word", "pos", "", "g0", "b0", "attention_mask"],
                         ["emb", "mask_index"], name="embed", domain=ms, epsilon=1e-12),
        helper.make_node("Attention", ["emb", "wqkv", "bqkv", "mask_index"], ["attn"], name="attention", domain=ms,
                         num_heads=heads),
        helper.make_node("MatMul", ["attn", "wo"], ["o"], name="out_proj"),
        helper.make_node("SkipLayerNormalization", ["o", "emb", "g1", "b1", "bo"], ["h1"], name="ln1", domain=ms,
                         epsilon=1e-12),
        helper.make_node("MatMul", ["h1", "w1"], ["f1"], name="ff1"),
        helper.make_node("BiasGelu", ["f1", "bf1"], ["gelu"], name="gelu", domain=ms),
        helper.make_node("MatMul", ["gelu", "w2"], ["f2"], name="ff2"),
        helper.make_node("SkipLayerNormalization", ["f2", "h1", "g2", "b2", "bf2"], ["hidden"], name="ln2",
                         domain=ms, epsilon=1e-12),
    ]
    inputs = [helper.make_tensor_value_info(n, TensorProto.INT32, ["batch", seq])
              for n in ("input_ids", "attention_mask")]
    graph = helper.make_graph(nodes, "ort_fused_bert", inputs,
                              [helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", seq, hidden])],
                              inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)])


def ort_fused_batches(n: int, seq: int = 16, seed: int = 0, vocab: int = 512) -> list[dict[str, np.ndarray]]:
    """Tokenized int32 batches (batch 1) for ort_fused_bert."""
    return [{k: v.astype(np.int32) for k, v in zoo.bert_inputs(1, seq, seed=seed + i, vocab=vocab).items()}
            for i in range(n)]
