"""Weight-only ONNX files (MatMulNBits, opset-21 blocked DQ) checked in onnxruntime, external data round trips."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from netquant.api.weight_only import quantize_weights_onnx
from netquant.core.blockwise import BlockSpec, WeightOnlyFormat, quantize_hqq, quantize_rtn
from netquant.errors import ConfigError, DataError
from netquant.passes.weight_only import WeightAlgorithm, WeightOnlyConfig
from tests.helpers.ir import make_model
from tests.helpers.llm_models import export_tiny_llama, tiny_llama, token_feeds


def _one_matmul(path: Path, k: int, n: int, gemm_bias: bool = False, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).standard_normal((k, n)).astype(np.float32) * 0.1
    inits = [numpy_helper.from_array(w, "W")]
    if gemm_bias:
        inits = [numpy_helper.from_array(w.T.copy(), "W"), numpy_helper.from_array(np.arange(n, dtype=np.float32), "C")]
        node = helper.make_node("Gemm", ["x", "W", "C"], ["y"], name="fc", transB=1)
        x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, k])
        y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])
    else:
        node = helper.make_node("MatMul", ["x", "W"], ["y"], name="fc")
        x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, k])
        y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, n])
    graph = helper.make_graph([node], "g", [x_info], [y_info], inits)
    onnx.save(make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return w


def _run(path: Path, x: np.ndarray,
         level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_DISABLE_ALL) -> np.ndarray:
    opts = ort.SessionOptions()
    opts.graph_optimization_level = level
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


@pytest.mark.parametrize("fmt", list(WeightOnlyFormat))
@pytest.mark.parametrize(("bits", "symmetric", "k"), [(4, True, 80), (4, False, 64), (8, True, 48), (8, False, 96)])
def test_file_computes_the_dequantized_weights_in_onnxruntime(tmp_path: Path, fmt: WeightOnlyFormat, bits: int,
                                                              symmetric: bool, k: int) -> None:
    w = _one_matmul(tmp_path / "m.onnx", k, 24)
    x = np.random.default_rng(1).standard_normal((2, 3, k)).astype(np.float32)
    config = WeightOnlyConfig(bits, 32 if k % 32 == 0 or fmt is WeightOnlyFormat.MATMUL_NBITS else 16, symmetric,
                              WeightAlgorithm.RTN, fmt, head_bits=None)  # the one MatMul is the output layer
    result = quantize_weights_onnx(tmp_path / "m.onnx", tmp_path / "q.onnx", config, [{"x": x}])
    expected = x @ quantize_rtn(torch.from_numpy(w), config.spec).dequantize().numpy()
    np.testing.assert_allclose(_run(tmp_path / "q.onnx", x), expected, rtol=1e-4, atol=1e-4)
    # with its optimizations onnxruntime fuses blocked DQ + MatMul into MatMulNBits with int8 activations
    fused = _run(tmp_path / "q.onnx", x, ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    assert float(np.dot(fused.ravel(), expected.ravel()) / np.linalg.norm(fused) / np.linalg.norm(expected)) > 0.999
    ops = {n.op_type for n in onnx.load(str(tmp_path / "q.onnx")).graph.node}
    assert ops == ({"MatMulNBits"} if fmt is WeightOnlyFormat.MATMUL_NBITS else {"DequantizeLinear", "MatMul"})
    assert result.cosine["y"] > 0.99
    assert result.layers[0].k == k and result.layers[0].n == 24


@pytest.mark.parametrize("fmt", list(WeightOnlyFormat))
def test_hqq_file_has_zero_points_and_lowers_the_output_error(tmp_path: Path, fmt: WeightOnlyFormat) -> None:
    """HQQ (asked with symmetric=True) writes asymmetric codes with per-block zero points (MatMulNBits' zero_points
    input, or the DQ's uint4 zero point); onnxruntime computes x @ its dequantized weight, and its output error vs
    FP32 is below RTN's on a fixed seed."""
    w = _one_matmul(tmp_path / "m.onnx", 128, 48, seed=5)
    w_heavy = w + 0.05 * np.random.default_rng(6).standard_normal(w.shape).astype(np.float32) ** 3
    model = onnx.load(str(tmp_path / "m.onnx"))
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(w_heavy, "W"))
    onnx.save(model, str(tmp_path / "m.onnx"))
    x = np.random.default_rng(1).standard_normal((2, 3, 128)).astype(np.float32)
    ref = x @ w_heavy
    errors = {}
    for algo in (WeightAlgorithm.RTN, WeightAlgorithm.HQQ):
        config = WeightOnlyConfig(4, 32, True, algo, fmt, head_bits=None)
        out = tmp_path / f"{algo.value}.onnx"
        quantize_weights_onnx(tmp_path / "m.onnx", out, config, [{"x": x}])
        got = _run(out, x)
        errors[algo] = float(((got - ref) ** 2).mean())
        proto = onnx.load(str(out))
        if algo is WeightAlgorithm.HQQ:
            node = proto.graph.node[0]
            if fmt is WeightOnlyFormat.MATMUL_NBITS:
                assert node.op_type == "MatMulNBits" and len(node.input) >= 4 and node.input[3]
            else:
                zp = next(t for t in proto.graph.initializer if t.name == node.input[2])
                assert zp.data_type == TensorProto.UINT4
            expected = x @ quantize_hqq(torch.from_numpy(w_heavy), config.spec).dequantize().numpy()
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert errors[WeightAlgorithm.HQQ] < errors[WeightAlgorithm.RTN]


def test_gemm_with_bias_and_transposed_weight(tmp_path: Path) -> None:
    w = _one_matmul(tmp_path / "m.onnx", 64, 16, gemm_bias=True)
    x = np.random.default_rng(2).standard_normal((3, 64)).astype(np.float32)
    for fmt in WeightOnlyFormat:
        quantize_weights_onnx(tmp_path / "m.onnx", tmp_path / f"q_{fmt.value}.onnx",
                              WeightOnlyConfig(4, 32, False, WeightAlgorithm.RTN, fmt, head_bits=None), [{"x": x}])
        got = _run(tmp_path / f"q_{fmt.value}.onnx", x)
        expected = x @ quantize_rtn(torch.from_numpy(w), BlockSpec(4, 32, False)).dequantize().numpy() + np.arange(16)
        np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_llm_with_external_data_round_trips_and_data_aware_beats_rtn(tmp_path: Path) -> None:
    src = export_tiny_llama(tiny_llama(), tmp_path / "llm.onnx", external=True)
    before = {p.name: _digest(p) for p in tmp_path.iterdir()}
    feeds = token_feeds(8)
    held_out = token_feeds(4, seed=9)
    ref = ort.InferenceSession(str(src)).run(None, held_out[0])[0]
    errors = {}
    for alg in WeightAlgorithm:
        out = tmp_path / f"q_{alg.value}.onnx"
        result = quantize_weights_onnx(src, out, WeightOnlyConfig(4, 32, True, alg), feeds)
        assert out.with_name(out.name + ".data").is_file()
        model = onnx.load(str(out), load_external_data=False)
        assert sum(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer) >= 15
        assert sum(n.op_type == "MatMulNBits" for n in model.graph.node) == 15
        # default head_bits=8: lm_head and the embedding table in int8 (NNCF's backup precision), the rest int4
        assert [r.bits for r in result.layers] == [4] * 14 + [8, 8] and result.layers[-1].n == 96  # the table last
        levels = [a.i for n in model.graph.node if n.op_type == "MatMulNBits" for a in n.attribute
                  if a.name == "accuracy_level"]
        assert levels == [0] * 14 + [4]  # 8-bit lm_head: onnxruntime's fast int8 kernel
        assert sum(n.op_type == "GatherBlockQuantized" for n in model.graph.node) == 1
        assert result.output_bytes < 0.35 * result.source_bytes
        got = ort.InferenceSession(str(out)).run(None, held_out[0])[0]
        errors[alg] = float(((got - ref) ** 2).mean())
    assert {p.name: _digest(p) for p in tmp_path.iterdir() if p.name in before} == before  # inputs untouched
    assert errors[WeightAlgorithm.GPTQ] < errors[WeightAlgorithm.RTN]
    assert errors[WeightAlgorithm.AWQ] < errors[WeightAlgorithm.RTN]


def test_refusals(tmp_path: Path) -> None:
    _one_matmul(tmp_path / "m.onnx", 32, 8)
    with pytest.raises(ConfigError, match="input model"):
        quantize_weights_onnx(tmp_path / "m.onnx", tmp_path / "m.onnx", WeightOnlyConfig())
    with pytest.raises(DataError, match="needs calibration data"):
        quantize_weights_onnx(tmp_path / "m.onnx", tmp_path / "q.onnx", WeightOnlyConfig(algorithm=WeightAlgorithm.GPTQ))
    assert not (tmp_path / "q.onnx").exists()


def test_netquant_executor_runs_the_weight_only_file_as_onnxruntime(tmp_path: Path) -> None:
    from tests.helpers.node_harness import run_model

    src = export_tiny_llama(tiny_llama(), tmp_path / "llm.onnx")
    feeds = token_feeds(2)
    # head_bits=None: every layer 4-bit at accuracy_level 0 (the executor computes MatMulNBits in float, level 0;
    # an int4 model's 8-bit layers are written at level 4, int8 activations, which it does not emulate)
    quantize_weights_onnx(src, tmp_path / "q.onnx", WeightOnlyConfig(4, 32, False, WeightAlgorithm.HQQ, head_bits=None),
                          feeds)
    model = onnx.load(str(tmp_path / "q.onnx"))
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = ort.InferenceSession(str(tmp_path / "q.onnx"), opts).run(None, feeds[1])[0]
    ours = run_model(model, [feeds[1]["input_ids"]])[0]
    np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-4, atol=1e-4)


def test_mixed_int4_int8_meets_the_budget_with_the_fewest_int8_layers(tmp_path: Path) -> None:
    src = export_tiny_llama(tiny_llama(), tmp_path / "llm.onnx")
    feeds = token_feeds(4)
    only4 = {"embeddings": False, "head_bits": None}  # every MatMul a candidate, nothing int4 the search cannot fix
    plain = quantize_weights_onnx(src, tmp_path / "q4.onnx", WeightOnlyConfig(4, 32, True, **only4), feeds)
    loss4 = 1 - plain.cosine["logits"]
    budget = loss4 / 3
    mixed = quantize_weights_onnx(src, tmp_path / "qm.onnx",
                                  WeightOnlyConfig(4, 32, True, max_loss=budget, **only4), feeds)
    search = mixed.mixed
    assert search is not None and search.met and 0 < search.int8_layers < 15
    assert 1 - mixed.cosine["logits"] <= budget + 1e-9  # the written file, checked again in onnxruntime
    assert search.tried[search.int8_layers - 1] > budget  # one fewer int8 layer misses the budget
    bits = [r.bits for r in mixed.layers]
    assert bits.count(8) == search.int8_layers
    sens = [r.sensitivity for r in mixed.layers]
    assert min(s for s, b in zip(sens, bits) if b == 8) >= max(s for s, b in zip(sens, bits) if b == 4)
    model = onnx.load(str(tmp_path / "qm.onnx"), load_external_data=False)
    assert sorted(a.i for n in model.graph.node for a in n.attribute if a.name == "bits") == sorted(bits)
    with pytest.raises(ConfigError, match="max_loss"):
        WeightOnlyConfig(8, 32, max_loss=0.01)


def test_without_calibration_data_the_file_is_still_checked_in_onnxruntime(tmp_path: Path) -> None:
    src = export_tiny_llama(tiny_llama(), tmp_path / "llm.onnx")
    result = quantize_weights_onnx(src, tmp_path / "q.onnx", WeightOnlyConfig(8, 32, True, accuracy_level=4))
    assert result.cosine["logits"] > 0.999  # int8 blocks, int8 activations in onnxruntime: near FP32
    model = onnx.load(str(tmp_path / "q.onnx"), load_external_data=False)
    assert {a.i for n in model.graph.node for a in n.attribute if a.name == "accuracy_level"} == {4}


def test_fp32_reference_beside_or_before_the_quantization_gives_the_same_file(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Small models run the FP32 reference on a background thread while quantizing, large ones (over OVERLAP_BYTES)
    first: the same bytes and the same onnxruntime cosines either way."""
    import netquant.passes.weight_only as pass_module

    src = export_tiny_llama(tiny_llama(), tmp_path / "llm.onnx")
    config = WeightOnlyConfig(4, 32, True, WeightAlgorithm.HQQ)
    beside = quantize_weights_onnx(src, tmp_path / "a.onnx", config, token_feeds(2))
    monkeypatch.setattr(pass_module, "OVERLAP_BYTES", 0)
    before = quantize_weights_onnx(src, tmp_path / "b.onnx", config, token_feeds(2))
    assert beside.cosine == before.cosine and beside.cosine["logits"] > 0.99
    digest = [hashlib.sha256((tmp_path / f"{x}.onnx.data").read_bytes()).hexdigest() for x in "ab"]
    assert digest[0] == digest[1]


@pytest.mark.parametrize("fmt", list(WeightOnlyFormat))
def test_embedding_tables_quantized_per_row_blocks(tmp_path: Path, fmt: WeightOnlyFormat) -> None:
    src = export_tiny_llama(tiny_llama(), tmp_path / "llm.onnx")
    plain = quantize_weights_onnx(src, tmp_path / "q.onnx",
                                  WeightOnlyConfig(4, 32, False, fmt=fmt, embeddings=False, head_bits=None))
    emb = quantize_weights_onnx(src, tmp_path / "qe.onnx", WeightOnlyConfig(4, 32, False, fmt=fmt, head_bits=None))
    assert len(emb.layers) == len(plain.layers) + 1 and emb.layers[-1].n == 96  # the 96 x 64 table
    assert emb.output_bytes < plain.output_bytes - 96 * 64 * 4 * 0.7
    model = onnx.load(str(tmp_path / "qe.onnx"), load_external_data=False)
    ops = [n.op_type for n in model.graph.node]
    assert ("GatherBlockQuantized" in ops) == (fmt is WeightOnlyFormat.MATMUL_NBITS)
    assert emb.cosine["logits"] > 0.98
    # the table onnxruntime gathers is the block dequantization of the rows
    ids = np.array([[1, 5, 95]])
    table = numpy_helper.to_array(next(t for t in onnx.load(str(src)).graph.initializer if t.name == "embed.weight"))
    from netquant.graph.weights import find_embedding_gathers

    assert len(find_embedding_gathers(onnx.load(str(src)))) == 1
    rows = quantize_rtn(torch.from_numpy(table).t(), BlockSpec(4, 32, False)).dequantize().t().numpy()[ids]
    probe = onnx.load(str(tmp_path / "qe.onnx"))
    gather_out = next(n.output[0] for n in probe.graph.node if n.op_type in ("Gather", "GatherBlockQuantized")
                      and "embed" in n.input[0])
    probe.graph.output.append(helper.make_empty_tensor_value_info(gather_out))
    got = ort.InferenceSession(probe.SerializeToString()).run([gather_out], {"input_ids": ids})[0]
    np.testing.assert_allclose(got, rows, rtol=1e-5, atol=1e-6)


def test_blocked_dq_file_of_a_decoder_with_onnxruntime_contrib_norms(tmp_path: Path) -> None:
    """The opset-21 upgrade for blocked DQ passes onnxruntime's SimplifiedLayerNormalization (an ONNX-domain op onnx
    has no schema for) through untouched: the file runs in onnxruntime and matches FP32."""
    from netquant.api.zoo_decoder import DecoderConfig, decode_feeds, random_weights, write_decoder_onnx

    config = DecoderConfig(vocab=64, dim=64, layers=2, heads=4, kv_heads=2, hidden=128, max_positions=64)
    src = write_decoder_onnx(tmp_path / "dec.onnx", config, random_weights(config, seed=0))
    out = tmp_path / "dec_dq.onnx"
    quantize_weights_onnx(src, out, WeightOnlyConfig(4, 32, True, fmt=WeightOnlyFormat.BLOCKED_DQ))
    model = onnx.load(str(out), load_external_data=False)
    assert max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")) >= 21
    assert "SimplifiedLayerNormalization" in {n.op_type for n in model.graph.node if n.domain == ""}
    feeds = decode_feeds(config, np.random.default_rng(3).integers(0, 64, (1, 12)))
    ref = ort.InferenceSession(str(src)).run(None, feeds)[0]
    got = ort.InferenceSession(str(out)).run(None, feeds)[0]
    cos = float((ref * got).sum() / np.sqrt((ref * ref).sum() * (got * got).sum()))
    assert cos > 0.99
