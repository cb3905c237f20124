"""The [N, K]-order fast paths of quantize_limited / pair_limited_scale equal the layout-generic computation."""

from __future__ import annotations

import pytest
import torch

from netquant.core import int_kernels as ik
from netquant.core.ops import quantize
from netquant.core.spec import QuantSpec, RoundingPolicy

CASES = [  # (weight shape, layout, per-channel axis or None)
    ((96, 40), ik.LayoutKind.ROWS, 1),  # MatMul B [K, N], per output column
    ((40, 96), ik.LayoutKind.COLS, 0),  # Gemm transB [N, K]
    ((16, 6, 3, 3), ik.LayoutKind.CONV_NHWC, 0),  # K = 54
    ((16, 3, 3, 3), ik.LayoutKind.CONV_NHWC, 0),  # odd K = 27: padded pair
    ((3, 31, 12), ik.LayoutKind.ROWS, 2),  # batched MatMul B, odd K
    ((64, 48), ik.LayoutKind.ROWS, None),  # per tensor
]


def _weight_and_scale(shape: tuple[int, ...], axis: int | None) -> tuple[torch.Tensor, torch.Tensor, QuantSpec]:
    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=gen) * torch.rand(shape, generator=gen).pow(4) * 3  # heavy tails: pairs over
    if axis is None:
        return w, (w.abs().max() / 127).reshape(()), QuantSpec.int8()
    amax = w.abs().amax(dim=[d for d in range(w.dim()) if d != axis])
    return w, amax / 127, QuantSpec.int8_per_channel(axis=axis)


def _generic_search(w: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor, spec: QuantSpec,
                    limit: ik.PairSumLimit) -> torch.Tensor:
    """The layout-generic 16-step search with pair_limited_scale's steps (s to s * (qmax - qmin) / 128)."""
    top = (spec.qmax - spec.qmin) / 2 / 64
    factors = torch.logspace(0, float(torch.log10(torch.tensor(top))), 16, dtype=torch.float64)
    return ik._pair_limited_scale_any(w, scale, zp, spec, limit, factors)


@pytest.mark.parametrize(("shape", "kind", "axis"), CASES)
def test_quantize_limited_matches_limit_pair_sums(shape: tuple[int, ...], kind: ik.LayoutKind,
                                                  axis: int | None) -> None:
    w, scale, spec = _weight_and_scale(shape, axis)
    zp = torch.zeros_like(scale, dtype=torch.int32)
    layout = ik.WeightLayout(kind)
    codes = quantize(w, scale, zp, spec)
    s = scale.double().reshape([-1 if d == axis else 1 for d in range(w.dim())]) if axis is not None else scale.double()
    reference = ik.limit_pair_sums(w.double() / s, codes, layout)  # the documented formula, whole tensor
    assert ik.count_overflow_pairs(codes, layout) > 0 and ik.count_overflow_pairs(reference, layout) == 0
    got = ik.quantize_limited(w, scale, zp, spec, ik.PairSumLimit(layout))
    assert torch.equal(got, reference)


@pytest.mark.parametrize(("shape", "kind", "axis"), CASES)
def test_pair_limited_scale_fast_path_matches_generic(shape: tuple[int, ...], kind: ik.LayoutKind,
                                                      axis: int | None) -> None:
    w, scale, spec = _weight_and_scale(shape, axis)
    zp = torch.zeros_like(scale, dtype=torch.int32)
    limit = ik.PairSumLimit(ik.WeightLayout(kind))
    assert ik._row_params(w, scale, zp, spec, limit.layout) is not None  # the fast path applies
    generic = _generic_search(w, scale, zp, spec, limit)
    fast = ik.pair_limited_scale(w, scale, zp, spec, limit)
    assert torch.equal(fast, generic)
    assert not torch.equal(fast, scale)  # the search moved some scale


@pytest.mark.parametrize("kind", [ik.LayoutKind.COLS, ik.LayoutKind.CONV_NHWC])
def test_pair_limited_scale_dense_blocks_match_generic(kind: ik.LayoutKind) -> None:
    """Weights whose every pair can exceed the limit (near-constant rows, as in onnx's light models) take the dense
    block path; the chosen scales still equal the layout-generic search."""
    gen = torch.Generator().manual_seed(3)
    shape = (24, 64) if kind is ik.LayoutKind.COLS else (24, 8, 3, 3)
    w = 0.5 + 0.01 * torch.rand(shape, generator=gen)  # every pair same-signed, |q0| + |q1| ~ 254 at amax / 127
    scale = w.reshape(shape[0], -1).abs().amax(1) / 127
    zp = torch.zeros_like(scale, dtype=torch.int32)
    spec = QuantSpec.int8_per_channel(axis=0)
    limit = ik.PairSumLimit(ik.WeightLayout(kind))
    fast = ik.pair_limited_scale(w, scale, zp, spec, limit)
    assert torch.equal(fast, _generic_search(w, scale, zp, spec, limit))
    assert ik.count_overflow_pairs(ik.quantize_limited(w, fast, zp, spec, limit), limit.layout) == 0


@pytest.mark.parametrize("heavy", [True, False])
def test_two_stage_search_of_long_rows_matches_exact_search(heavy: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rows of >= SAMPLED_SEARCH_PAIRS pairs (VGG-like fc layers) rank steps on a strided sample plus every candidate
    pair's limit correction, then verify the best VERIFIED_STEPS exactly: the weights' total squared error stays
    within 0.01% of the exact 16-step search's, and most channels get the same scale."""
    gen = torch.Generator().manual_seed(11)
    shape = (48, 2 * ik.SAMPLED_SEARCH_PAIRS + 2 * 700)
    w = torch.randn(shape, generator=gen)
    if heavy:
        w = w * torch.rand(shape, generator=gen).pow(4) * 3
    scale = w.abs().amax(1) / 127
    zp = torch.zeros_like(scale, dtype=torch.int32)
    spec = QuantSpec.int8_per_channel(axis=0)
    limit = ik.PairSumLimit(ik.WeightLayout(ik.LayoutKind.COLS))
    two_stage = ik.pair_limited_scale(w, scale, zp, spec, limit)
    monkeypatch.setattr(ik, "SAMPLED_SEARCH_PAIRS", 10**9)
    exact = ik.pair_limited_scale(w, scale, zp, spec, limit)

    def error(s: torch.Tensor) -> float:
        return float(((ik.quantize_limited(w, s, zp, spec, limit) * s[:, None] - w).double() ** 2).sum())

    assert not torch.equal(exact, scale)  # the exact search moved scales: the comparison is not trivial
    assert error(two_stage) <= error(exact) * 1.0001
    assert float((two_stage == exact).float().mean()) >= 0.9


@pytest.mark.parametrize(("shape", "kind"), [((16, 2 * ik.SAMPLED_SEARCH_PAIRS), ik.LayoutKind.COLS),
                                           ((24, 8, 3, 3), ik.LayoutKind.CONV_NHWC)])
def test_search_of_constant_rows_matches_generic(shape: tuple[int, ...], kind: ik.LayoutKind) -> None:
    """onnx's light models: every weight 0.02, every pair limited. Blocks of identical rows are evaluated on one row,
    sampled and exact errors rank steps alike: the generic search's scales."""
    w = torch.full(shape, 0.02)
    scale = w.reshape(shape[0], -1).abs().amax(1) / 127
    zp = torch.zeros_like(scale, dtype=torch.int32)
    spec = QuantSpec.int8_per_channel(axis=0)
    limit = ik.PairSumLimit(ik.WeightLayout(kind))
    assert torch.equal(ik.pair_limited_scale(w, scale, zp, spec, limit), _generic_search(w, scale, zp, spec, limit))


def _where_limited_error(x0: torch.Tensor, x1: torch.Tensor, inv: torch.Tensor, spec: QuantSpec,
                         lim: float) -> torch.Tensor:
    """The dense blocks' per-pair error as written before the float-only form: where(over, limited, plain)."""
    from netquant.core.rounding import round_with_policy_

    qmin, qmax = float(spec.qmin), float(spec.qmax)
    t0, t1 = x0 * inv, x1 * inv
    q0 = round_with_policy_(t0.clone(), spec.rounding, sign_source=t0).clamp_(qmin, qmax)
    q1 = round_with_policy_(t1.clone(), spec.rounding, sign_source=t1).clamp_(qmin, qmax)
    over = (q0 * q1 > 0) & ((q0 + q1).abs() > lim)
    sign = t0.sign()
    r0 = ((t0 - t1) * sign + lim).div(2).clamp(lim - 127, 127).round()
    plain = (q0 - t0).square() + (q1 - t1).square()
    limited = (t0 * sign - r0).square() + (t1 * sign - lim + r0).square()
    return torch.where(over, limited, plain)


@pytest.mark.parametrize("rounding", list(RoundingPolicy))
def test_dense_limited_error_is_bitwise_the_where_form(rounding: RoundingPolicy) -> None:
    """_limited_error computes in float arithmetic only (a 0 / 1 mask, limited * over + plain * (1 - over)): every
    element's bits equal where(over, limited, plain) (strided pairs, zeros, exact ties, pairs at and over the limit),
    so pair_limited_scale's sums, and the scales it picks, are unchanged."""
    gen = torch.Generator().manual_seed(5)
    spec = QuantSpec.int8_per_channel(axis=0, rounding=rounding)
    for trial in range(40):
        x = torch.randn(9, 2 * 37, generator=gen) * torch.rand(9, 2 * 37, generator=gen).pow(3)
        if trial % 2:
            x[:, 1::2] = x[:, 0::2] * 0.97  # same-signed pairs: many over the limit
        x[0, :6] = torch.tensor([0.0, -0.0, 0.5, -0.5, 64.5 / 150, 63.5 / 150])  # zeros, ties at inv 2 and 150
        inv = torch.rand(6, 9, 1, generator=gen) * 300 + 1
        inv[0, 0, 0], inv[1, 0, 0] = 2.0, 150.0
        x0, x1 = x[:, 0::2], x[:, 1::2]  # strided views, as _block_errors passes them
        got = ik._limited_error(x0, x1, inv, spec, 128.0)
        want = _where_limited_error(x0, x1, inv, spec, 128.0)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), trial
    assert bool((want > 0).any())  # not all zero: the comparison is not trivial
