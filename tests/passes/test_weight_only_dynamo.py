"""Weight-only quantization of transformers decoders exported with the dynamo exporter (KV cache inputs / outputs):
the files onnxruntime runs, checked against the FP32 export at prefill and at a decode step with a cache, and the
netquant executor runs them as onnxruntime does. Skipped without the optional `transformers` package."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

from netquant.api.weight_only import quantize_weights_onnx  # noqa: E402
from netquant.data.tokens import decoder_feeds  # noqa: E402
from netquant.export.weight_only import cosine  # noqa: E402
from netquant.passes.weight_only import WeightAlgorithm, WeightOnlyConfig  # noqa: E402
from tests.helpers.hf_decoders import export_hf_decoder, tiny_hf_decoder  # noqa: E402


def _session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen2", marks=pytest.mark.slow)])
def test_dynamo_decoder_with_kv_cache_quantizes_and_runs(tmp_path: Path, kind: str) -> None:
    from tests.helpers.node_harness import run_model

    src = tmp_path / "fp32.onnx"
    names = export_hf_decoder(tiny_hf_decoder(kind), src)
    model = onnx.load(str(src), load_external_data=False)
    feeds = decoder_feeds(model, np.random.default_rng(0).integers(0, 128, size=(6, 12)))  # empty caches
    out = tmp_path / "q.onnx"
    # head_bits=None: lm_head and the embedding in int4 too, every MatMulNBits at accuracy_level 0 (float compute,
    # what the executor computes; the default int8 lm_head runs at level 4 in onnxruntime)
    result = quantize_weights_onnx(src, out, WeightOnlyConfig(4, 32, True, WeightAlgorithm.GPTQ, head_bits=None), feeds)
    # 7 linears a layer + lm_head as MatMulNBits, the embedding GatherBlockQuantized
    ops = [n.op_type for n in onnx.load(str(out), load_external_data=False).graph.node]
    assert ops.count("MatMulNBits") == 15 and ops.count("GatherBlockQuantized") == 1
    assert [r.bits for r in result.layers] == [4] * 16
    assert min(result.cosine.values()) > 0.99  # logits and every present tensor, prefill
    # a decode step with a 12-token cache: the quantized file follows FP32
    fp32, q = _session(src), _session(out)
    prefill = fp32.run(None, feeds[0])
    step = {"input_ids": np.array([[7]], dtype=np.int64), "attention_mask": np.ones((1, 13), dtype=np.int64),
            **dict(zip(names[2:], prefill[1:], strict=True))}
    want, got = fp32.run(None, step), q.run(None, step)
    assert got[1].shape == (1, 2, 13, 16)
    agreement = [cosine(g, w) for g, w in zip(got, want, strict=True)]
    assert min(agreement) > 0.97, agreement  # all int4, embedding and lm_head included: one-token logits
    # the netquant executor runs the weight-only file (MatMulNBits, GatherBlockQuantized, the exporter's ops) as ORT
    ours = run_model(onnx.load(str(out)), [step[i.name] for i in q.get_inputs()])
    for a, b in zip(ours, got, strict=True):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-4)
