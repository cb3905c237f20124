"""com.microsoft Attention / MultiHeadAttention / EmbedLayerNormalization: the executor against onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from tests.helpers.node_harness import ort_and_ours

MS = {"com.microsoft": 1}
B, S, N, H = 2, 6, 3, 4
D = N * H


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def _close(ref: list[np.ndarray], ours: list[np.ndarray], n: int = 1) -> None:
    for r, o in list(zip(ref, ours, strict=False))[:n]:
        np.testing.assert_allclose(o, r, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize(("mask", "unidirectional"), [
    ("none", 0), ("raw", 0), ("lengths", 0), ("start_end", 0), ("3d", 0), ("none", 1), ("raw", 1), ("lengths", 1)])
def test_attention_matches_onnxruntime(mask: str, unidirectional: int) -> None:
    rng = _rng(1)
    feeds = {"x": rng.standard_normal((B, S, 8)).astype(np.float32),
             "w": (rng.standard_normal((8, 3 * D)) * 0.3).astype(np.float32),
             "b": rng.standard_normal(3 * D).astype(np.float32)}
    names = ["x", "w", "b"]
    if mask != "none":
        lengths = np.array([S, 3], np.int32)
        feeds["m"] = {"raw": (np.arange(S)[None] < lengths[:, None]).astype(np.int32),
                      "lengths": lengths,
                      "start_end": np.array([S, 4, 1, 0], np.int32),
                      "3d": (rng.random((B, S, S)) > 0.3).astype(np.int32)}[mask]
        names.append("m")
    node = helper.make_node("Attention", names, ["y"], domain="com.microsoft", num_heads=N,
                            unidirectional=unidirectional)
    _close(*ort_and_ours(node, feeds, domain_opsets=MS))


def test_attention_with_qkv_sizes_scale_and_bias_input() -> None:
    rng = _rng(2)
    feeds = {"x": rng.standard_normal((B, S, 8)).astype(np.float32),
             "w": (rng.standard_normal((8, D + D + 2 * D)) * 0.3).astype(np.float32),
             "b": rng.standard_normal(4 * D).astype(np.float32),
             "ab": rng.standard_normal((1, N, S, S)).astype(np.float32)}
    node = helper.make_node("Attention", ["x", "w", "b", "", "", "ab"], ["y"], domain="com.microsoft", num_heads=N,
                            qkv_hidden_sizes=[D, D, 2 * D], scale=0.3, mask_filter_value=-1000.0)
    _close(*ort_and_ours(node, feeds, domain_opsets=MS))


@pytest.mark.parametrize("mask", ["none", "raw", "lengths"])
def test_multi_head_attention_matches_onnxruntime(mask: str) -> None:
    rng = _rng(3)
    t = 5
    feeds = {"q": rng.standard_normal((B, S, D)).astype(np.float32),
             "k": rng.standard_normal((B, t, D)).astype(np.float32),
             "v": rng.standard_normal((B, t, D)).astype(np.float32),
             "bias": rng.standard_normal(3 * D).astype(np.float32)}
    names = ["q", "k", "v", "bias"]
    if mask != "none":
        lengths = np.array([t, 2], np.int32)
        feeds["m"] = (np.arange(t)[None] < lengths[:, None]).astype(np.int32) if mask == "raw" else lengths
        names.append("m")
    node = helper.make_node("MultiHeadAttention", names, ["y"], domain="com.microsoft", num_heads=N)
    _close(*ort_and_ours(node, feeds, domain_opsets=MS))


@pytest.mark.parametrize("with_segment", [False, True])
def test_embed_layer_norm_matches_onnxruntime(with_segment: bool) -> None:
    rng = _rng(4)
    vocab, hidden = 30, 8
    feeds = {"ids": rng.integers(0, vocab, (B, S)).astype(np.int32)}
    names = ["ids", "seg" if with_segment else ""]
    if with_segment:
        feeds["seg"] = rng.integers(0, 2, (B, S)).astype(np.int32)
    feeds.update({"word": rng.standard_normal((vocab, hidden)).astype(np.float32),
                  "pos": rng.standard_normal((16, hidden)).astype(np.float32)})
    names += ["word", "pos"]
    if with_segment:
        feeds["segemb"] = rng.standard_normal((2, hidden)).astype(np.float32)
    names.append("segemb" if with_segment else "")
    feeds.update({"gamma": rng.standard_normal(hidden).astype(np.float32),
                  "beta": rng.standard_normal(hidden).astype(np.float32),
                  "mask": (np.arange(S)[None] < np.array([[S], [2]])).astype(np.int32)})
    names += ["gamma", "beta", "mask"]
    node = helper.make_node("EmbedLayerNormalization", names, ["y", "mask_index"], domain="com.microsoft",
                            epsilon=1e-12)
    ref, ours = ort_and_ours(node, feeds, domain_opsets=MS)
    np.testing.assert_allclose(ours[0], ref[0], atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(ours[1], ref[1])


def test_unidirectional_with_a_3d_mask_is_refused_by_name() -> None:
    from netquant.errors import UnsupportedOpError
    from tests.helpers.node_harness import run_model, single_node_model

    rng = _rng(5)
    feeds = {"x": rng.standard_normal((B, S, 8)).astype(np.float32),
             "w": rng.standard_normal((8, 3 * D)).astype(np.float32),
             "b": np.zeros(3 * D, np.float32), "m": np.ones((B, S, S), np.int32)}
    node = helper.make_node("Attention", list(feeds), ["y"], name="attn", domain="com.microsoft", num_heads=N,
                            unidirectional=1)
    with pytest.raises(UnsupportedOpError, match="attn.*unidirectional"):
        run_model(single_node_model(node, feeds, domain_opsets=MS), list(feeds.values()))
