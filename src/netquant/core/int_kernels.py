"""How CPU int8 kernels accumulate u8 x s8 products, and int8 weights that no kernel can overflow.

    exact:     acc = sum_k a_k * w_k                                            (int32)
    pairwise:  acc = sum_j sat16(a_{2j} * w_{2j} + a_{2j+1} * w_{2j+1})         (x86 vpmaddubsw)

a: raw uint8 activation codes (0..255, the zero point is subtracted after accumulation),
w: int8 weight codes, k: the position in the kernel's reduction order (`WeightLayout`).
A pair of one sign with |w0| + |w1| <= PAIR_LIMIT cannot saturate for any a: 255 * 128 = 32640.
Pairs of opposite signs never saturate (255 * 127 < 32767).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from netquant.core.rounding import round_with_policy_
from netquant.core.spec import Granularity, QuantSpec, RoundingPolicy

PAIR_LIMIT = 128
INT16_MIN, INT16_MAX = -32768, 32767
_CHUNK_ELEMS = 1 << 22  # bound on the temporary pair-sum tensor of the emulation


class Accumulation(enum.Enum):
    """How an int8 kernel sums u8 x s8 products."""

    EXACT = "exact"  # int32: VNNI (vpdpbusd), AMX, ARM64 sdot/udot/smmla, u8u8 and s8s8 kernels
    PAIRWISE_INT16 = "pairwise_int16"  # x86 AVX2 / AVX-512BW without VNNI: vpmaddubsw saturates a pair in int16


class LayoutKind(enum.Enum):
    """Where a weight's reduction dim K lies and the order the kernel walks it in."""

    CONV_NHWC = "conv_nhwc"  # Conv weight [O, C/g, *k]: K = tap * C/g + c (onnxruntime's NHWC im2col)
    ROWS = "rows"  # [..., K, N]: MatMul B, Gemm B with transB=0
    COLS = "cols"  # [N, K]: Gemm B with transB=1


@dataclass(frozen=True)
class WeightLayout:
    """Maps a weight tensor to the [N, K] matrix whose rows an int8 kernel reduces, pairs (2j, 2j+1)."""

    kind: LayoutKind

    def to_nk(self, w: torch.Tensor) -> torch.Tensor:
        if self.kind is LayoutKind.CONV_NHWC:
            o, cg = w.shape[0], w.shape[1]
            return w.reshape(o, cg, -1).transpose(1, 2).reshape(o, -1)
        if self.kind is LayoutKind.ROWS:
            k = w.shape[-2]
            return w.transpose(-1, -2).reshape(-1, k)
        return w.reshape(w.shape[0], -1)

    def from_nk(self, m: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        if self.kind is LayoutKind.CONV_NHWC:
            o, cg = shape[0], shape[1]
            return m.reshape(o, -1, cg).transpose(1, 2).reshape(shape)
        if self.kind is LayoutKind.ROWS:
            lead = (*shape[:-2], shape[-1], shape[-2])
            return m.reshape(lead).transpose(-1, -2).contiguous()
        return m.reshape(shape)


def _pairs(m: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N, ceil(K/2), 2], K padded with a zero column when odd."""
    if m.shape[-1] % 2:
        m = F.pad(m, (0, 1))
    return m.reshape(m.shape[0], -1, 2)


def overflow_pairs(w_nk: torch.Tensor, limit: int = PAIR_LIMIT) -> torch.Tensor:
    """Bool [N, ceil(K/2)]: pairs of integer weights that a saturating int16 pair sum can overflow."""
    p = _pairs(w_nk.to(torch.int32))
    return (p[..., 0] * p[..., 1] > 0) & (p.abs().sum(-1) > limit)


def count_overflow_pairs(codes: torch.Tensor, layout: WeightLayout, limit: int = PAIR_LIMIT) -> int:
    """How many weight pairs (in the kernel's reduction order) could saturate."""
    return int(overflow_pairs(layout.to_nk(codes), limit).sum())


def _over_pair_index(nk: torch.Tensor, limit: int) -> torch.Tensor:
    """Flat indices (into the [N, ceil(K/2)] pairs) of same-sign pairs with |q0| + |q1| > limit; nk holds
    integer codes (any dtype); counted in int16 (|q| <= 256 there), the cheapest exact type."""
    p = _pairs(nk.to(torch.int16))
    q0, q1 = p[..., 0], p[..., 1]
    if nk.dtype == torch.int8 and limit >= 128:
        # |q| <= 128 <= limit: a pair of opposite signs (or with a 0) has |q0 + q1| <= limit, a same-sign pair
        # |q0 + q1| = |q0| + |q1|; so over <=> |q0 + q1| > limit
        return torch.add(q0, q1).abs_().gt_(limit).reshape(-1).nonzero().squeeze(1)
    over = (q0.abs() + q1.abs()).gt_(limit)
    over &= (q0 > 0) == (q1 > 0)
    over &= (q0 != 0) & (q1 != 0)
    return over.reshape(-1).nonzero().squeeze(1)


def limit_pair_sums(real_codes: torch.Tensor, codes: torch.Tensor, layout: WeightLayout,
                    limit: int = PAIR_LIMIT, max_code: int = 127) -> torch.Tensor:
    """Integer weights with |q0| + |q1| <= limit in every same-sign pair (no int16 pair saturation).

    real_codes: w / scale (unrounded), codes: the rounded codes. A pair over the limit moves to the
    closest point of |q0| + |q1| = limit (both magnitudes lowered by the same amount, then rounded);
    other pairs are unchanged.  Only the pairs over the limit are gathered, computed (float64) and written.
    """
    nk = layout.to_nk(codes)
    idx = _over_pair_index(nk, limit)
    if idx.numel() == 0:
        return codes
    v = _pairs(layout.to_nk(real_codes)).reshape(-1, 2).index_select(0, idx).to(torch.float64).abs()
    q = _pairs(nk.to(torch.float64))
    flat_pairs = q.reshape(-1, 2)
    sign = torch.sign(flat_pairs[idx, 0])
    m0 = v[:, 0] - (v.sum(-1) - limit) / 2
    r0 = torch.round(m0.clamp(limit - max_code, max_code))
    flat_pairs.index_copy_(0, idx, torch.stack([r0, limit - r0], -1) * sign[:, None])
    flat = flat_pairs.reshape(q.shape[0], -1)[:, : nk.shape[1]]
    return layout.from_nk(flat, codes.shape).to(codes.dtype)


def _saturated_minus_exact(a0: torch.Tensor, a1: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor) -> torch.Tensor:
    p = a0 * w0 + a1 * w1
    return p.clamp(INT16_MIN, INT16_MAX) - p


def pairwise_correction(a: torch.Tensor, w_nk: torch.Tensor, limit: int = PAIR_LIMIT) -> torch.Tensor:
    """sum_j sat16(pair_j) - sum_j pair_j for a [..., M, K] (raw u8 codes) and w [N, K]: [..., M, N] float64.

    Only pairs that can overflow contribute, so a saturation-free weight costs nothing.
    """
    over = overflow_pairs(w_nk, limit)
    out = torch.zeros((*a.shape[:-1], w_nk.shape[0]), dtype=torch.float64)
    if not bool(over.any()):
        return out
    n_idx, j_idx = over.nonzero(as_tuple=True)
    wp = _pairs(w_nk.to(torch.float64))
    ap = a.to(torch.float64)
    if ap.shape[-1] % 2:
        ap = F.pad(ap, (0, 1))
    rows = max(1, ap[..., 0].numel())
    step = max(1, _CHUNK_ELEMS // rows)
    for s in range(0, n_idx.numel(), step):
        n, j = n_idx[s:s + step], j_idx[s:s + step]
        corr = _saturated_minus_exact(ap[..., 2 * j], ap[..., 2 * j + 1], wp[n, j, 0], wp[n, j, 1])
        out.index_add_(out.dim() - 1, n, corr)
    return out


def int_matmul(a: torch.Tensor, w_nk: torch.Tensor, accumulation: Accumulation) -> torch.Tensor:
    """acc[..., m, n] = sum_k a[..., m, k] * w[n, k] as the kernel computes it (float64 holding integers)."""
    exact = torch.matmul(a.to(torch.float64), w_nk.to(torch.float64).t())
    if accumulation is Accumulation.PAIRWISE_INT16:
        exact = exact + pairwise_correction(a, w_nk)
    return exact


def conv_pairwise_correction(x_codes: torch.Tensor, w_codes: torch.Tensor, *, group: int,
                             strides: list[int], dilations: list[int], pads: list[int],
                             pad_value: float) -> torch.Tensor:
    """The saturation term of a 1-D / 2-D convolution under PAIRWISE_INT16, in onnxruntime's NHWC K order.

    x_codes: [N, C, *spatial] raw u8 codes; w_codes: [O, C/group, *k]; pads: ONNX begin..end pads
    (padded positions hold the input zero point `pad_value`). Returns [N, O, *out_spatial] float64.
    """
    spatial = x_codes.dim() - 2
    if spatial == 1:
        x_codes, w_codes = x_codes.unsqueeze(2), w_codes.unsqueeze(2)
        strides, dilations, pads = [1, *strides], [1, *dilations], [0, pads[0], 0, pads[1]]
    elif spatial != 2:
        raise ValueError(f"saturation emulation covers 1-D and 2-D convolutions, not {spatial}-D")
    n, c, h, w = x_codes.shape
    o, cg, kh, kw = w_codes.shape
    taps = kh * kw
    layout = WeightLayout(LayoutKind.CONV_NHWC)
    w_nk = layout.to_nk(w_codes)
    over = overflow_pairs(w_nk)
    xp = F.pad(x_codes.to(torch.float64), (pads[1], pads[3], pads[0], pads[2]), value=pad_value)
    oh = (xp.shape[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
    ow = (xp.shape[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
    out = torch.zeros((n, o, oh * ow), dtype=torch.float64)
    if bool(over.any()):
        o_idx, j_idx = over.nonzero(as_tuple=True)
        wp = _pairs(w_nk.to(torch.float64))
        k_total = cg * taps
        out_per_group = o // group

        def unfold_row(k: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
            # K index (tap * cg + c) of group g -> row of F.unfold's (channel * taps + tap) order
            return (g * cg + k % cg) * taps + k // cg

        g_idx = o_idx // out_per_group
        k0, k1 = 2 * j_idx, 2 * j_idx + 1
        valid1 = k1 < k_total
        r0 = unfold_row(k0, g_idx)
        r1 = unfold_row(torch.where(valid1, k1, k0), g_idx)
        step = max(1, _CHUNK_ELEMS // (oh * ow))
        for b in range(n):
            cols = F.unfold(xp[b:b + 1], (kh, kw), dilation=dilations, stride=strides)[0]  # [C*taps, L]
            for s in range(0, o_idx.numel(), step):
                sl = slice(s, s + step)
                a0 = cols[r0[sl]]
                a1 = torch.where(valid1[sl, None], cols[r1[sl]], torch.zeros_like(a0))
                corr = _saturated_minus_exact(a0, a1, wp[o_idx[sl], j_idx[sl], 0][:, None],
                                              wp[o_idx[sl], j_idx[sl], 1][:, None])
                out[b].index_add_(0, o_idx[sl], corr)
    out = out.reshape(n, o, oh, ow)
    return out.squeeze(2) if spatial == 1 else out


@dataclass(frozen=True)
class PairSumLimit:
    """A weight's integer codes keep |q0| + |q1| <= limit in every same-sign pair of `layout`'s K order."""

    layout: WeightLayout
    limit: int = PAIR_LIMIT

    def apply(self, real_codes: torch.Tensor, codes: torch.Tensor) -> torch.Tensor:
        return limit_pair_sums(real_codes, codes, self.layout, self.limit)


def _row_params(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec,
                layout: WeightLayout) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Scale and zero point (float64) of each row of layout.to_nk(x): scalars per tensor, [rows] per channel
    when the channel axis is the kernel's output dim N; None when the params do not map onto rows."""
    if scale.numel() == 1 and zero_point.numel() == 1:
        return scale.to(torch.float64).reshape(()), zero_point.to(torch.float64).reshape(())
    if spec.granularity is not Granularity.PER_CHANNEL or spec.axis is None or x.dim() < 2:
        return None
    axis = spec.axis % x.dim()
    if layout.kind is LayoutKind.ROWS:
        if axis != x.dim() - 1:
            return None
        repeat = x[..., 0, 0].numel()  # rows are (leading..., n)
    elif axis == 0:
        repeat = 1
    else:
        return None

    def per_row(p: torch.Tensor) -> torch.Tensor:
        p = p.to(torch.float64).reshape(-1)
        p = p.expand(x.shape[axis]) if p.numel() == 1 else p
        return p.repeat(repeat) if repeat > 1 else p

    return per_row(scale), per_row(zero_point)


def _limit_nk_(codes_nk: torch.Tensor, x_nk: torch.Tensor, s_row: torch.Tensor, z_row: torch.Tensor, limit: int,
               max_code: int = 127) -> bool:
    """limit_pair_sums on `codes_nk` [N, K'] (integer codes, K' even, edited in place) whose unpadded columns are
    x_nk [N, K] (float, any strides: only the pairs over the limit are read) under the per-row (or scalar) scale and
    zero point: real = x / s - z in float64, as limit_pair_sums' callers compute it. False when no pair is over.
    A padded column's code is 0, so its pair is never over the limit."""
    idx = _over_pair_index(codes_nk, limit)
    if idx.numel() == 0:
        return False
    half = codes_nk.shape[1] // 2
    rows = torch.div(idx, half, rounding_mode="floor")
    col = (idx - rows * half) * 2
    xv = torch.stack([x_nk[rows, col], x_nk[rows, col + 1]], -1).to(torch.float64)
    if s_row.dim():
        v = (xv / s_row.index_select(0, rows)[:, None] - z_row.index_select(0, rows)[:, None]).abs()
    else:
        v = (xv / s_row - z_row).abs()
    pairs = codes_nk.view(-1, 2)
    sign = torch.sign(pairs[:, 0].index_select(0, idx).to(torch.float64))
    m0 = v[:, 0] - (v.sum(-1) - limit) / 2
    r0 = torch.round(m0.clamp(limit - max_code, max_code))
    pairs.index_copy_(0, idx, (torch.stack([r0, limit - r0], -1) * sign[:, None]).to(codes_nk.dtype))
    return True


def _even_nk(t: torch.Tensor, layout: WeightLayout) -> torch.Tensor:
    """layout.to_nk(t) as a new contiguous tensor, with a zero column appended when K is odd (the pairs' padding)."""
    nk = layout.to_nk(t)
    return F.pad(nk, (0, 1)) if nk.shape[-1] % 2 else nk.clone(memory_format=torch.contiguous_format)


def quantize_limited(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec,
                     limit: PairSumLimit | None) -> torch.Tensor:
    """Integer codes of x under spec, then `limit` applied (None: plain core.ops.quantize)."""
    from netquant.core.ops import quantize

    codes = quantize(x, scale, zero_point, spec)
    if limit is None:
        return codes
    rows = _row_params(x, scale, zero_point, spec, limit.layout)
    if rows is not None:  # only the pairs over the limit are read and written, in the kernel's [N, K] order
        codes_nk = _even_nk(codes, limit.layout)
        if not _limit_nk_(codes_nk, limit.layout.to_nk(x), *rows, limit.limit):
            return codes
        k = codes.numel() // codes_nk.shape[0]
        return limit.layout.from_nk(codes_nk[:, :k], codes.shape)
    s = scale.to(torch.float64)
    if s.numel() > 1 and spec.axis is not None:
        shape = [1] * x.dim()
        shape[spec.axis % x.dim()] = -1
        s = s.reshape(shape)
    real = x.to(torch.float64) / s - zero_point.to(torch.float64).reshape(s.shape if s.dim() else ())
    return limit.apply(real, codes)


def pair_limited_scale(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec,
                       limit: PairSumLimit, steps: int = 16) -> torch.Tensor:
    """Per channel (or per tensor), the scale in [s, s * r] whose pair-limited codes minimise sum (x - s q)^2.

    r = (qmax - qmin) / 2 / 64 grows the scale until every code fits in [-64, 64] (no pair can exceed 128), so
    the choice is never worse than 7-bit weights; at s most pairs keep full 8-bit precision.
    """
    top = (spec.qmax - spec.qmin) / 2 / 64
    factors = torch.logspace(0, float(torch.log10(torch.tensor(top))), steps, dtype=torch.float64)
    if _row_params(x, scale, zero_point, spec, limit.layout) is not None:
        return _pair_limited_scale_nk(x, scale, zero_point, spec, limit, factors)
    return _pair_limited_scale_any(x, scale, zero_point, spec, limit, factors)


def _pair_limited_scale_any(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec,
                            limit: PairSumLimit, factors: torch.Tensor) -> torch.Tensor:
    """pair_limited_scale in x's own layout (any params; quantize_limited per step)."""
    per_channel = scale.numel() > 1 and spec.axis is not None
    axis = spec.axis % x.dim() if per_channel else None
    reduce = [d for d in range(x.dim()) if d != axis]
    best_err: torch.Tensor | None = None
    best = scale.clone()
    for f in factors:
        s = (scale.double() * f).to(scale.dtype)
        codes = quantize_limited(x, s, zero_point, spec, limit).double()
        sb = s.double().reshape([-1 if d == axis else 1 for d in range(x.dim())]) if per_channel else s.double()
        zb = zero_point.double().reshape(sb.shape) if per_channel else zero_point.double()
        err = ((x.double() - (codes - zb) * sb) ** 2).sum(reduce) if reduce else (x.double() - (codes - zb) * sb) ** 2
        err = err.reshape(scale.shape)
        if best_err is None:
            best_err = err
            continue
        better = err < best_err
        best = torch.where(better, s, best)
        best_err = torch.where(better, err, best_err)
    return best


_SEARCH_BLOCK_ELEMS = 1 << 20  # steps x rows x K evaluated at once (4 MB a buffer): bounded memory, and few enough
# blocks that the per-block op overhead stays small (BERT-base: 1 << 18 took 2x as long, the same scales)
SAMPLED_SEARCH_PAIRS = 2048  # rows of this many pairs or more (K >= 4096) are searched in two stages ...
SAMPLE_PAIRS = 512  # ... every step estimated on about this many evenly strided pairs per row, then ...
VERIFIED_STEPS = 3  # ... the best this many steps of each channel exact, on every pair


def _pair_limited_scale_nk(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec,
                           limit: PairSumLimit, factors: torch.Tensor) -> torch.Tensor:
    """pair_limited_scale in the kernel's [N, K] order, float32, a block of rows at a time with every step at once:

        t = x * (1/s)  (as core.ops.quantize),  q = clamp(round(t), qmin, qmax),
        same-sign pairs with |q0| + |q1| > limit moved to |q0| + |q1| = limit (as limit_pair_sums),
        err(step, channel) = sum over the channel's rows of s^2 * sum_k (t_k - q_k)^2.

    Per channel the first step of least error wins. Rows of SAMPLED_SEARCH_PAIRS pairs or more (large fully
    connected layers: VGG's 25088-wide fc6) first rank the steps by an estimate: the plain rounding error of every
    m-th pair (m = pairs // SAMPLE_PAIRS) times m, plus the limit correction of every candidate pair, exactly (the
    few pairs near the limit carry most of the difference between steps, so a sample of them would not do); then
    the exact error of each channel's VERIFIED_STEPS best decides: about (16 / m + 3) full passes instead of 16.
    Symmetric weights only (zero point 0): others take the layout-generic search."""
    if bool(zero_point.any()):
        return _pair_limited_scale_any(x, scale, zero_point, spec, limit, factors)
    x_nk = limit.layout.to_nk(x).to(torch.float32)
    flat = scale.reshape(-1)
    if x_nk.shape[0] > 1 and bool((x_nk == x_nk.reshape(-1)[0]).all()) and bool((flat == flat[0]).all()):
        # one value under one scale (a constant-initialized layer): every row's search is the first row's
        return _search_rows(x_nk[:1], flat[:1], spec, limit, factors).expand(flat.shape).reshape(scale.shape).clone()
    return _search_rows(x_nk, flat, spec, limit, factors).reshape(scale.shape)


def _search_rows(x_nk: torch.Tensor, scale: torch.Tensor, spec: QuantSpec, limit: PairSumLimit,
                 factors: torch.Tensor) -> torch.Tensor:
    """_pair_limited_scale_nk's search on rows x_nk [N, K] (float32; row r is channel r % C) under per-channel
    scales `scale` [C]; the chosen scale per channel, [C]."""
    if x_nk.shape[1] % 2:
        x_nk = F.pad(x_nk, (0, 1))  # the pad's code is 0: its pair never exceeds the limit, its error is 0
    x_nk = x_nk.contiguous()
    n, k = x_nk.shape
    channels = scale.numel()
    row_channel = torch.arange(n) % channels  # rows are (leading..., channel) or one per channel
    steps = torch.stack([(scale.double() * f).to(scale.dtype).reshape(-1) for f in factors])  # [S, C]
    s_rows = steps.to(torch.float32)[:, row_channel]  # [S, N]
    inv_rows = torch.reciprocal(s_rows)
    inv_max = inv_rows.amax(0)  # the smallest scale of each row: its largest |t|
    pairs = k // 2
    if pairs < SAMPLED_SEARCH_PAIRS:
        best = _channel_errors(x_nk, inv_rows, s_rows, inv_max, spec, limit, channels).argmin(0)  # first minimum
        return steps[best, torch.arange(channels)].reshape(scale.shape)
    ranked = _channel_errors(x_nk, inv_rows, s_rows, inv_max, spec, limit, channels, pairs // SAMPLE_PAIRS)
    # each channel's best steps by sampled error (ties: the smaller scale), in step order
    chosen = ranked.argsort(dim=0, stable=True)[:VERIFIED_STEPS].sort(0).values  # [V, C]
    exact = _channel_errors(x_nk, inv_rows.gather(0, chosen[:, row_channel]), s_rows.gather(0, chosen[:, row_channel]),
                            inv_max, spec, limit, channels)  # [V, C]
    best = chosen.gather(0, exact.argmin(0, keepdim=True))[0]
    return steps[best, torch.arange(channels)].reshape(scale.shape)


def _channel_errors(x_nk: torch.Tensor, inv_rows: torch.Tensor, s_rows: torch.Tensor, inv_max: torch.Tensor,
                    spec: QuantSpec, limit: PairSumLimit, channels: int, stride: int = 1) -> torch.Tensor:
    """[S, C]: per candidate (row-wise 1/s in inv_rows [S, N], s in s_rows) and channel, sum of s^2 (t - n)^2 over
    the channel's rows of x_nk [N, K] (n: codes with the pair limit applied), a block of rows at a time
    (_block_errors); a block whose rows and scales all repeat its first (constant-initialized weights) is
    evaluated on that row once."""
    n, k = x_nk.shape
    s_count = inv_rows.shape[0]
    errs = torch.empty((s_count, n), dtype=torch.float64)
    block = max(1, _SEARCH_BLOCK_ELEMS // (s_count * -(-k // stride)))
    for r in range(0, n, block):
        xb, inv, top = x_nk[r:r + block], inv_rows[:, r:r + block], inv_max[r:r + block]  # [R, K], [S, R], [R]
        rows = xb.shape[0]
        if rows > 1 and torch.equal(xb, xb[:1].expand_as(xb)) and torch.equal(inv, inv[:, :1].expand_as(inv)):
            errs[:, r:r + block] = _block_errors(xb[:1], inv[:, :1], top[:1], spec, limit, stride).expand(-1, rows)
        else:
            errs[:, r:r + block] = _block_errors(xb, inv, top, spec, limit, stride)
    errs.mul_(s_rows.double().square())
    return errs.reshape(s_count, -1, channels).sum(1)


def _block_errors(xb: torch.Tensor, inv: torch.Tensor, inv_max: torch.Tensor, spec: QuantSpec, limit: PairSumLimit,
                  stride: int) -> torch.Tensor:
    """[S, R]: per step and row of xb [R, K] (1/s = inv [S, R]), sum over pairs of the squared code error with the
    pair limit applied, in units of s^2.

    The plain rounding error is summed over every element; only the candidate pairs, those whose |t0| + |t1| at
    the row's smallest scale (1/s = inv_max) exceeds limit - 1 (no other pair can round over the limit at any
    step), are gathered and corrected for the limit; blocks where most pairs are candidates (near-constant
    weights) are limited in place on the pair halves. stride > 1: an estimate, the plain (or, in dense blocks,
    limited) error of every stride-th pair scaled up to all pairs, the candidates' corrections exact."""
    qmin, qmax, lim = float(spec.qmin), float(spec.qmax), float(limit.limit)
    pairs_per_row = xb.shape[1] // 2
    spread = pairs_per_row / -(-pairs_per_row // stride)  # all pairs / sampled pairs
    x0, x1 = xb[:, 0::2], xb[:, 1::2]
    reach = (x0.abs() + x1.abs()).mul_(inv_max[:, None])
    candidate = (reach > lim - 1) & (x0 * x1 > 0)
    count = int(candidate.sum())
    if count > candidate.numel() // 4:  # dense (e.g. constant weights): every pair limited, no gather
        err = _limited_error(x0[:, ::stride], x1[:, ::stride], inv[:, :, None], spec, lim).sum(-1)
        return err.mul_(spread) if stride > 1 else err
    if stride > 1:
        xb = xb.view(xb.shape[0], -1, 2)[:, ::stride].reshape(xb.shape[0], -1)
    t = xb.unsqueeze(0) * inv[:, :, None]  # [S, R, K]
    if spec.rounding is RoundingPolicy.ROUND_HALF_EVEN:
        q = torch.round(t)  # (a new buffer: the clone round_with_policy_ needs is this one)
    else:
        q = round_with_policy_(t.clone(), spec.rounding, sign_source=t)
    # |t| <= max |x| * max (1/s) (1 + 2^-23) below min(qmax, -qmin) + 0.5 rounds inside [qmin, qmax]: no clamp
    if float(xb.abs().amax()) * float(inv.amax()) * (1 + 2.0 ** -20) >= min(qmax, -qmin) + 0.5:
        q.clamp_(qmin, qmax)
    d = t.sub_(q)
    err = d.mul_(d).sum(-1)  # [S, R]
    if stride > 1:
        err.mul_(spread)
    if count:
        rows, pairs = candidate.nonzero(as_tuple=True)
        err.index_add_(1, rows, _limit_correction(x0[rows, pairs], x1[rows, pairs], inv[:, rows], spec, lim))
    return err


def _limited_codes(x0: torch.Tensor, x1: torch.Tensor, inv: torch.Tensor, spec: QuantSpec, lim: float
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(t0, t1, q0, q1, n0, n1) of pairs (x0, x1) at 1/s = `inv` (broadcast): t = x / s, q the plain codes, n the
    codes with the pair limit applied (as limit_pair_sums: v = |t|, m0 = v0 - (v0 + v1 - limit) / 2, a pair over
    the limit -> sign * (r0, limit - r0), r0 = round(clamp(m0, limit - 127, 127)))."""
    qmin, qmax = float(spec.qmin), float(spec.qmax)
    t0, t1 = x0 * inv, x1 * inv
    q0 = round_with_policy_(t0.clone(), spec.rounding, sign_source=t0).clamp_(qmin, qmax)
    q1 = round_with_policy_(t1.clone(), spec.rounding, sign_source=t1).clamp_(qmin, qmax)
    over = (q0 * q1 > 0) & (q0.abs() + q1.abs() > lim)
    sign = t0.sign()
    r0 = (t0 - t1).mul_(sign).add_(lim).div_(2).clamp_(lim - 127, 127).round_()
    n0 = torch.where(over, r0 * sign, q0)
    n1 = torch.where(over, r0.neg_().add_(lim).mul_(sign), q1)
    return t0, t1, q0, q1, n0, n1


def _limited_error(x0: torch.Tensor, x1: torch.Tensor, inv: torch.Tensor, spec: QuantSpec, lim: float
                   ) -> torch.Tensor:
    """Per pair, the squared code error with the pair limit applied (the codes of _limited_codes), in fewer passes:
    a pair over the limit (same-sign codes: |q0| + |q1| = |q0 + q1| > limit) errs (|t0| - r0)^2 + (|t1| - (limit -
    r0))^2, any other (t0 - q0)^2 + (t1 - q1)^2."""
    qmin, qmax = float(spec.qmin), float(spec.qmax)
    # in float arithmetic only (torch's bool comparisons and where cost several float passes each on the CPU), every
    # step exact, so the same bits as where(over, limited, plain): the pairs are made contiguous first (a product
    # with a strided operand costs 5-10x), over is 0 / 1 from integer-valued codes (q0 q1 >= 1: same sign;
    # |q0 + q1| - limit >= 1: over it), and the choice limited * over + plain * (1 - over) adds an exact 0
    t0, t1 = x0.contiguous() * inv, x1.contiguous() * inv
    if spec.rounding is RoundingPolicy.ROUND_HALF_EVEN:
        q0, q1 = torch.round(t0).clamp_(qmin, qmax), torch.round(t1).clamp_(qmin, qmax)
    else:
        q0 = round_with_policy_(t0.clone(), spec.rounding, sign_source=t0).clamp_(qmin, qmax)
        q1 = round_with_policy_(t1.clone(), spec.rounding, sign_source=t1).clamp_(qmin, qmax)
    over = (q0 * q1).clamp_(0, 1).mul_((q0 + q1).abs_().sub_(lim).clamp_(0, 1))
    sign = t0.sign()
    r0 = (t0 - t1).mul_(sign).add_(lim).div_(2).clamp_(lim - 127, 127).round_()
    plain = q0.sub_(t0).square_().add_(q1.sub_(t1).square_())
    limited = t0.mul_(sign).sub_(r0).square_().add_(t1.mul_(sign).sub_(lim).add_(r0).square_())
    return limited.mul_(over).add_(plain.mul_(over.neg_().add_(1)))


def _limit_correction(x0: torch.Tensor, x1: torch.Tensor, inv: torch.Tensor, spec: QuantSpec,
                      lim: float) -> torch.Tensor:
    """Per pair, the squared code error with the pair limit applied less the plain rounding error (0 where the pair
    stays within the limit); pairs (x0, x1) [*P], `inv` broadcast to [S, *P]."""
    t0, t1, q0, q1, n0, n1 = _limited_codes(x0, x1, inv, spec, lim)
    plain = (t0 - q0).square_().add_((t1 - q1).square_())
    return t0.sub_(n0).square_().add_(t1.sub_(n1).square_()).sub_(plain)
