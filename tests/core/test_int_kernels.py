"""Integer accumulation emulation (exact / pairwise int16) against plain numpy integer references, and the
host probe against what onnxruntime really computes on this machine."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from netquant.core.int_kernels import (
    PAIR_LIMIT,
    Accumulation,
    LayoutKind,
    PairSumLimit,
    WeightLayout,
    conv_pairwise_correction,
    count_overflow_pairs,
    int_matmul,
    limit_pair_sums,
    quantize_limited,
)
from netquant.core.spec import QuantSpec
from netquant.platforms.targets import host_accumulation
from tests.helpers.ir import make_model

RNG = np.random.default_rng(0)


def numpy_matmul(a: np.ndarray, w_nk: np.ndarray, pairwise: bool) -> np.ndarray:
    """Reference: products in K order, pairs (2j, 2j+1) summed and clipped to int16 when pairwise."""
    prod = a.astype(np.int64)[:, None, :] * w_nk.astype(np.int64)[None, :, :]  # [M, N, K]
    if prod.shape[-1] % 2:
        prod = np.concatenate([prod, np.zeros((*prod.shape[:-1], 1), np.int64)], -1)
    pairs = prod.reshape(*prod.shape[:-1], -1, 2).sum(-1)
    if pairwise:
        pairs = np.clip(pairs, -32768, 32767)
    return pairs.sum(-1)


def numpy_conv(x: np.ndarray, w: np.ndarray, pad: int, pad_value: int, group: int, pairwise: bool) -> np.ndarray:
    """Reference conv, stride 1: each output is the NHWC-ordered dot product (tap-major, channel-minor)."""
    n, c, h, wd = x.shape
    o, cg, kh, kw = w.shape
    xp = np.pad(x.astype(np.int64), ((0, 0), (0, 0), (pad, pad), (pad, pad)), constant_values=pad_value)
    oh, ow = h + 2 * pad - kh + 1, wd + 2 * pad - kw + 1
    out = np.zeros((n, o, oh, ow), np.int64)
    per_group = o // group
    for oc in range(o):
        g = oc // per_group
        wk = w[oc].transpose(1, 2, 0).reshape(-1)
        for i in range(oh):
            for j in range(ow):
                patch = xp[:, g * cg:(g + 1) * cg, i:i + kh, j:j + kw].transpose(0, 2, 3, 1).reshape(n, -1)
                out[:, oc, i, j] = numpy_matmul(patch, wk[None, :], pairwise)[:, 0]
    return out


@pytest.mark.parametrize("k", [16, 33])
@pytest.mark.parametrize("acc", list(Accumulation))
def test_int_matmul_matches_numpy_reference(k: int, acc: Accumulation) -> None:
    a = RNG.integers(0, 256, (5, k)).astype(np.uint8)
    w = RNG.integers(-128, 128, (7, k)).astype(np.int8)
    got = int_matmul(torch.from_numpy(a), torch.from_numpy(w), acc).numpy().astype(np.int64)
    np.testing.assert_array_equal(got, numpy_matmul(a, w, acc is Accumulation.PAIRWISE_INT16))


@pytest.mark.parametrize(("c", "group", "pad_value"), [(6, 1, 0), (3, 1, 0), (8, 2, 7)])
def test_conv_saturation_term_matches_numpy_reference(c: int, group: int, pad_value: int) -> None:
    x = RNG.integers(0, 256, (2, c, 5, 6)).astype(np.uint8)
    w = RNG.integers(-128, 128, (4, c // group, 3, 3)).astype(np.int8)
    corr = conv_pairwise_correction(torch.from_numpy(x), torch.from_numpy(w), group=group, strides=[1, 1],
                                    dilations=[1, 1], pads=[1, 1, 1, 1], pad_value=pad_value)
    want = (numpy_conv(x, w, 1, pad_value, group, True) - numpy_conv(x, w, 1, pad_value, group, False))
    assert np.abs(want).max() > 0  # full-range weights do saturate
    np.testing.assert_array_equal(corr.numpy().astype(np.int64), want)


def test_limit_pair_sums_moves_only_overflowing_pairs_to_the_limit() -> None:
    real = torch.tensor([[100.2, 90.4, -120.0, -30.0, 127.0, -127.0, 60.6, 67.6, 3.0]])
    codes = torch.round(real).to(torch.int8)
    got = limit_pair_sums(real, codes, WeightLayout(LayoutKind.COLS))
    # (100.2, 90.4): both lowered by (190.6 - 128) / 2 = 31.3 -> (68.9, 59.1) -> (69, 59)
    # (-120, -30): lowered by 11 -> (-109, -19); (127, -127): opposite signs, kept; (60.6, 67.6) -> (61, 68)
    # sums to 129 > 128: lowered by 0.1 -> (60.5, 67.5) -> (60, 68) (round half to even, partner takes the rest)
    assert got.tolist() == [[69, 59, -109, -19, 127, -127, 60, 68, 3]]
    assert count_overflow_pairs(got, WeightLayout(LayoutKind.COLS)) == 0


def _ort_matmul_integer(a: np.ndarray, b_kn: np.ndarray) -> np.ndarray:
    graph = helper.make_graph([helper.make_node("MatMulInteger", ["a", "b"], ["y"])], "g",
                              [helper.make_tensor_value_info("a", TensorProto.UINT8, list(a.shape))],
                              [helper.make_tensor_value_info("y", TensorProto.INT32, None)],
                              [numpy_helper.from_array(b_kn, "b")])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]


def test_probe_matches_what_onnxruntime_computes() -> None:
    """The probe's family reproduces ORT's MatMulInteger bit for bit on full-range weights; the other does not."""
    a = RNG.integers(200, 256, (8, 64)).astype(np.uint8)
    b = RNG.integers(-128, 128, (64, 16)).astype(np.int8)
    y = _ort_matmul_integer(a, b).astype(np.int64)
    host = host_accumulation()
    w_nk = WeightLayout(LayoutKind.ROWS).to_nk(torch.from_numpy(b))
    ours = {acc: int_matmul(torch.from_numpy(a), w_nk, acc).numpy().astype(np.int64) for acc in Accumulation}
    np.testing.assert_array_equal(y, ours[host])
    other = next(acc for acc in Accumulation if acc is not host)
    assert not np.array_equal(y, ours[other])


def test_pair_limited_weights_are_exact_in_onnxruntime() -> None:
    """Pair-limited int8 weights give the exact int32 result in ORT whatever the CPU."""
    a = RNG.integers(200, 256, (8, 64)).astype(np.uint8)
    w = torch.from_numpy(RNG.standard_normal((64, 16)).astype(np.float32))
    spec = QuantSpec.int8_per_channel(axis=1)
    scale = w.abs().amax(0) / 127
    limit = PairSumLimit(WeightLayout(LayoutKind.ROWS))
    codes = quantize_limited(w, scale, torch.zeros(16, dtype=torch.int32), spec, limit)
    assert codes.abs().max() == 127  # still 8-bit
    pairs = codes.t().reshape(16, 32, 2).to(torch.int32)
    same_sign = pairs[..., 0] * pairs[..., 1] > 0
    assert int(pairs.abs().sum(-1)[same_sign].max()) <= PAIR_LIMIT
    y = _ort_matmul_integer(a, codes.numpy())
    np.testing.assert_array_equal(y, a.astype(np.int64) @ codes.numpy().astype(np.int64))
