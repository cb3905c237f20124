"""quantize_torch on a Hugging Face transformers model (BertModel from a small config, random weights): keyword
inputs, dynamic batch and sequence, the quantized file checked in onnxruntime against the torch model."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import netquant

transformers = pytest.importorskip("transformers")  # the optional extra netquant[hf]

VOCAB = 1000


def _bert() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=128, max_position_embeddings=64)
    return transformers.BertModel(cfg).eval()


def _inputs(batch: int, seq: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, VOCAB, (batch, seq), dtype=np.int64)
    mask = np.ones((batch, seq), dtype=np.int64)
    mask[0, seq - seq // 4:] = 0  # a padded row
    types = np.zeros((batch, seq), dtype=np.int64)
    types[:, seq // 2:] = 1
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.mark.slow  # torch.export traces BertModel in ~20 s on the 2-core box
def test_bert_model_keyword_inputs_dynamic_batch_and_sequence(tmp_path):
    model = _bert()
    example = {k: torch.from_numpy(v) for k, v in _inputs(1, 16, seed=0).items()}  # batch 1: still dynamic
    calib = [_inputs(2, 16 if i % 2 else 24, seed=i) for i in range(8)]
    qm = netquant.quantize_torch(model, example, calib, quiet=True, objective=None)
    path = qm.export(tmp_path / "bert_int8.onnx").path
    proto = onnx.load(str(path))
    assert [i.name for i in proto.graph.input] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [o.name for o in proto.graph.output] == ["last_hidden_state", "pooler_output"]
    dims = [d.dim_param for d in proto.graph.input[0].type.tensor_type.shape.dim]
    assert dims == ["batch", "sequence"]
    ops = {n.op_type for n in proto.graph.node}
    assert "DequantizeLinear" in ops
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        for seq in (16, 40):
            feeds = _inputs(batch, seq, seed=100 + batch * seq)
            with torch.no_grad():
                ref = model(**{k: torch.from_numpy(v) for k, v in feeds.items()})
            hidden, pooled = sess.run(None, feeds)
            assert hidden.shape == (batch, seq, 64) and pooled.shape == (batch, 64)
            assert _cosine(ref.last_hidden_state.numpy(), hidden) > 0.995, (batch, seq)
            assert _cosine(ref.pooler_output.numpy(), pooled) > 0.995, (batch, seq)
