"""Block-wise weight-only numerics: hand-checked RTN codes, packing, and GPTQ / AWQ / HQQ vs RTN on a fixed seed."""

from __future__ import annotations

import pytest
import torch

from netquant.core.awq import awq_search
from netquant.core.blockwise import (
    BlockSpec,
    pack_codes,
    quantize_clip_search,
    quantize_hqq,
    quantize_rtn,
    unpack_codes,
)
from netquant.core.gptq import quantize_gptq
from netquant.errors import ConfigError


def test_rtn_symmetric_codes_by_hand() -> None:
    # one output channel, one block of 16: extreme -1.6 (negative) -> s = 1.6 / 8 = 0.2, codes = round(w / s) + 8
    w = torch.tensor([[-1.6, 0.2, 0.3, 0.5, 1.0, -0.1, 0.0, 0.7, 1.4, -1.0, 0.1, 0.6, -0.4, 0.25, 0.35, 0.9]]).t()
    bq = quantize_rtn(w, BlockSpec(4, 16, True))
    assert torch.allclose(bq.scales, torch.tensor([[0.2]]))
    expected = [0, 9, 10, 10, 13, 8, 8, 12, 15, 3, 8, 11, 6, 9, 10, 12]  # round half to even: 0.3/0.2 = 1.5 -> 2
    assert bq.codes[0].tolist() == expected
    # extreme positive 1.4 -> s = 1.4 / 7 and 1.4 lands exactly on code 15
    bq = quantize_rtn(torch.tensor([[1.4] + [0.1] * 15]).t(), BlockSpec(4, 16, True))
    assert bq.scales.item() == pytest.approx(0.2)
    assert bq.codes[0, 0].item() == 15
    assert torch.allclose(bq.dequantize()[0, 0], torch.tensor(1.4))


def test_rtn_asymmetric_and_padding() -> None:
    torch.manual_seed(0)
    w = torch.rand(40, 3) + 0.5  # all positive: the range includes 0, K = 40 pads to 48
    spec = BlockSpec(4, 16, False)
    bq = quantize_rtn(w, spec)
    assert bq.codes.shape == (3, 48) and bq.scales.shape == (3, 3)
    lo, hi = 0.0, w.t()[0, :16].max()
    assert bq.scales[0, 0].item() == pytest.approx(float(hi - lo) / 15)
    assert bq.zero_points[0, 0].item() == 0
    err = (bq.dequantize() - w).abs()
    assert float(err.max()) <= float(bq.scales.max()) / 2 + 1e-6
    assert bq.dequantize().shape == w.shape


def test_pack_roundtrip_low_nibble_first() -> None:
    codes = torch.tensor([[1, 2, 15, 0, 7]], dtype=torch.uint8)
    packed = pack_codes(codes, 4)
    assert packed.tolist() == [[0x21, 0x0F, 0x07]]
    assert unpack_codes(packed, 4, 5).tolist() == codes.tolist()


def test_spec_checks() -> None:
    with pytest.raises(ConfigError, match="bits"):
        BlockSpec(3, 32)
    with pytest.raises(ConfigError, match="power of two"):
        BlockSpec(4, 48)


def _layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k, n, t = 128, 64, 512
    mix = torch.randn(k, k, generator=g) / k**0.5
    x = torch.randn(t, k, generator=g) @ mix + 0.1 * torch.randn(t, k, generator=g)
    x[:, :4] *= 20  # salient channels
    w = torch.randn(k, n, generator=g) * 0.05
    return x, w


def _out_err(x: torch.Tensor, w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float(((x @ w_hat - x @ w) ** 2).mean())


def test_gptq_and_awq_beat_rtn_on_output_error() -> None:
    x, w = _layer()
    spec = BlockSpec(4, 32, True)
    rtn = _out_err(x, w, quantize_rtn(w, spec).dequantize())
    gptq = _out_err(x, w, quantize_gptq(w, 2 * x.t() @ x / x.shape[0], spec).dequantize())
    gptq_ao = _out_err(x, w, quantize_gptq(w, 2 * x.t() @ x / x.shape[0], spec, act_order=True).dequantize())
    awq = awq_search(x, [w], spec)
    awq_err = float((((x / awq.scale) @ awq.quantized[0].dequantize() - x @ w) ** 2).mean())
    assert gptq < 0.3 * rtn and gptq_ao < 0.3 * rtn
    assert awq.alpha > 0 and awq_err < 0.8 * rtn


def test_gptq_moves_codes_within_range_and_is_deterministic() -> None:
    x, w = _layer(1)
    h = 2 * x.t() @ x / x.shape[0]
    a = quantize_gptq(w, h, BlockSpec(4, 32, False))
    b = quantize_gptq(w, h, BlockSpec(4, 32, False))
    assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
    assert int(a.codes.max()) <= 15


def test_hqq_and_clip_search_lower_weight_error() -> None:
    """On a fixed heavy-tailed weight: the clip search lowers the squared error vs RTN; HQQ (asymmetric, its zero
    points and scales moved) lowers both the mean |error| it optimizes and the squared error vs asymmetric RTN, in
    every block never raises the |error| sum, and is deterministic."""
    _, w = _layer(2)
    w = w + 0.3 * torch.randn(w.shape, generator=torch.Generator().manual_seed(3)) ** 3  # heavy tails
    spec = BlockSpec(4, 64, False)
    rtn_q = quantize_rtn(w, spec)
    rtn = float(((rtn_q.dequantize() - w) ** 2).mean())
    clip = float(((quantize_clip_search(w, spec).dequantize() - w) ** 2).mean())
    assert clip < rtn
    hqq_q = quantize_hqq(w, spec)
    hqq = float(((hqq_q.dequantize() - w) ** 2).mean())
    assert hqq < 0.985 * rtn
    assert float((hqq_q.dequantize() - w).abs().mean()) < 0.98 * float((rtn_q.dequantize() - w).abs().mean())
    per_block = [(q.dequantize() - w).abs().t().reshape(w.shape[1], -1, 64).sum(-1) for q in (hqq_q, rtn_q)]
    assert bool((per_block[0] <= per_block[1] * (1 + 1e-5)).all())
    assert not torch.equal(hqq_q.scales, rtn_q.scales)
    assert hqq_q.known_mse == pytest.approx(hqq, rel=1e-4)
    again = quantize_hqq(w, BlockSpec(4, 64, True), threads=2)  # asymmetric whatever the spec; any thread count
    assert not again.spec.symmetric and torch.equal(again.codes, hqq_q.codes) and torch.equal(again.scales,
                                                                                               hqq_q.scales)


def test_layout_and_mse_match_the_row_definition() -> None:
    """quantize_rtn / quantize_hqq give the same codes for a [K, N] weight stored either way (a Gemm transB view), and
    mse() is mean((dequantize() - w)^2); padded K (40 in blocks of 32) included."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(40, 24, generator=g)
    for quantize in (quantize_rtn, quantize_hqq):
        for spec in (BlockSpec(4, 32, True), BlockSpec(4, 16, False), BlockSpec(8, 32, True)):
            a = quantize(w, spec)
            b = quantize(w.t().contiguous().t(), spec)
            assert torch.equal(a.codes, b.codes) and torch.equal(a.scales, b.scales)
            blocks = -(-40 // spec.block_size)
            assert a.codes.shape == (24, blocks * spec.block_size) and a.scales.shape == (24, blocks)
            assert a.mse(w) == pytest.approx(float(((a.dequantize() - w) ** 2).mean()), rel=1e-5)


def test_rtn_steps_threads_and_known_error() -> None:
    """The fused RTN gives the same codes, scales and error for 1 and 2 threads and for a weight split into many steps
    (a wide weight: column ranges), its known_mse is mse(), and 4-bit packing matches pairs taken one by one."""
    w = torch.randn(96, 5000, generator=torch.Generator().manual_seed(4))  # 96 x 5000: column-range steps at block 32
    for spec in (BlockSpec(4, 32, True), BlockSpec(4, 32, False), BlockSpec(8, 64, True)):
        one, two = quantize_rtn(w, spec), quantize_rtn(w.numpy(), spec, threads=2)
        assert torch.equal(one.codes, two.codes) and torch.equal(one.scales, two.scales)
        assert one.known_mse == two.known_mse == pytest.approx(one.mse(w), rel=1e-4)
    codes = quantize_rtn(w, BlockSpec(4, 32, True)).codes
    packed = pack_codes(codes, 4)
    assert torch.equal(packed, codes[:, 0::2] | (codes[:, 1::2] << 4))
    assert torch.equal(unpack_codes(packed, 4, codes.shape[1]), codes)
