"""Decoder-LLM com.microsoft ops against onnxruntime: MatMulNBits, RotaryEmbedding, GroupQueryAttention."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper as oh

from tests.helpers.node_harness import ort_and_ours

MS = {"com.microsoft": 1}
RNG = np.random.default_rng(3)


def _f32(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize(("bits", "k", "with_zp", "bias"), [(4, 64, False, False), (4, 80, True, True),
                                                           (8, 48, True, False), (8, 64, False, True)])
def test_matmul_nbits(bits: int, k: int, with_zp: bool, bias: bool) -> None:
    n, bs = 12, 16
    nb = -(-k // bs)
    blob = bs * bits // 8
    inputs = {"a": _f32(2, 3, k), "b": RNG.integers(0, 256, size=(n, nb, blob), dtype=np.uint8),
              "scales": (np.abs(_f32(n * nb)) * 0.1).astype(np.float32)}
    names = ["a", "b", "scales"]
    if with_zp:
        zp_bytes = n * (-(-nb * bits // 8))
        inputs["zp"] = RNG.integers(0, 256, size=(zp_bytes,), dtype=np.uint8)
        names.append("zp")
    if bias:
        if not with_zp:
            names.append("")
        inputs["bias"] = _f32(n)
        names += ["", "bias"]
    node = oh.make_node("MatMulNBits", names, ["y"], domain="com.microsoft", K=k, N=n, bits=bits, block_size=bs)
    ref, ours = ort_and_ours(node, inputs, domain_opsets=MS)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding(interleaved: int) -> None:
    b, s, h, d = 2, 5, 3, 8
    inputs = {"x": _f32(b, s, h * d), "pos": np.array([[0, 1, 2, 3, 4], [3, 4, 5, 6, 7]], dtype=np.int64),
              "cos": _f32(16, d // 2), "sin": _f32(16, d // 2)}
    node = oh.make_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], ["y"], domain="com.microsoft",
                        interleaved=interleaved, num_heads=h)
    ref, ours = ort_and_ours(node, inputs, domain_opsets=MS)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("s", "past", "rotary"), [(6, 0, False), (1, 5, False), (4, 0, True), (1, 7, True)])
def test_group_query_attention(s: int, past: int, rotary: bool) -> None:
    b, h, hkv, d = 1, 4, 2, 16  # onnxruntime's rotary needs head_size % 16 == 0
    total = past + s
    inputs = {"q": _f32(b, s, h * d), "k": _f32(b, s, hkv * d), "v": _f32(b, s, hkv * d),
              "past_k": _f32(b, hkv, past, d), "past_v": _f32(b, hkv, past, d),
              "seqlens_k": np.array([total - 1], dtype=np.int32), "total": np.array(total, dtype=np.int32)}
    names = list(inputs)
    attrs = {"num_heads": h, "kv_num_heads": hkv}
    if rotary:
        inputs["cos"], inputs["sin"] = np.cos(_f32(32, d // 2)), np.sin(_f32(32, d // 2))
        names += ["cos", "sin"]
        attrs["do_rotary"] = 1
    node = oh.make_node("GroupQueryAttention", names, ["y", "present_k", "present_v"], domain="com.microsoft",
                        **attrs)
    ref, ours = ort_and_ours(node, inputs, domain_opsets=MS)
    for r, o in zip(ref, ours):
        assert r.shape == o.shape
        np.testing.assert_allclose(o, r, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(("bits", "d", "with_zp"), [(4, 64, True), (4, 80, False), (8, 48, True)])
def test_gather_block_quantized(bits: int, d: int, with_zp: bool) -> None:
    v, bs = 11, 16
    nb = -(-d // bs)
    inputs = {"data": RNG.integers(0, 256, size=(v, d * bits // 8), dtype=np.uint8),
              "ids": np.array([[0, 5, 10, -1], [3, 3, 2, 1]], dtype=np.int64),
              "scales": (np.abs(_f32(v, nb)) * 0.1).astype(np.float32)}
    if with_zp:
        inputs["zp"] = RNG.integers(0, 256, size=(v, -(-nb * bits // 8)), dtype=np.uint8)
    node = oh.make_node("GatherBlockQuantized", list(inputs), ["y"], domain="com.microsoft", gather_axis=0,
                        quantize_axis=1, block_size=bs, bits=bits)
    ref, ours = ort_and_ours(node, inputs, domain_opsets=MS)
    np.testing.assert_allclose(ours[0], ref[0], rtol=1e-5, atol=1e-6)
