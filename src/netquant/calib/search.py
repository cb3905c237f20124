"""Threshold searches on a histogram: TensorRT entropy (KL), percentile, torch.ao L2 range.

All take one channel's counts (float64, n bins) and return a bin index; edges are the caller's.
"""

from __future__ import annotations

import bisect

import torch

from netquant.errors import ConfigError


def entropy_divergences(counts: torch.Tensor, num_quant_bins: int = 128, start_bin: int = 128,
                        stride: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(P_i || Q_i) for every candidate i = start_bin, start_bin + stride, ..., n (TensorRT).

    P_i: the histogram (bin 0 replaced by bin 1) cut at i bins, the cut-off tail added to bin i-1.
    Q_i: bins [0, i) merged into `num_quant_bins` groups (bin j -> group floor(j * Q / i)); each
    group's mass is spread evenly over its non-empty bins, empty bins stay empty.
    Returns (candidates, divergences); inf where P has mass that Q cannot represent.

    Vectorized: group masses and non-empty counts come from prefix sums, so the cost is
    O(candidates * Q) with no Python loop over candidates.
    """
    n = counts.numel()
    bins = counts.to(torch.float64).clone()
    if n > 1:
        bins[0] = bins[1]
    total = bins.sum()
    if n <= start_bin:
        cand = torch.tensor([n], dtype=torch.int64)
    else:
        cand = torch.arange(start_bin, n + 1, stride, dtype=torch.int64)
    q = num_quant_bins
    zero = torch.zeros(1, dtype=torch.float64)
    cum = torch.cat([zero, bins.cumsum(0)])  # cum[j] = sum(bins[:j])
    nonzero = torch.cat([zero, (bins > 0).to(torch.float64).cumsum(0)])
    blogb = torch.where(bins > 0, bins * torch.log(torch.where(bins > 0, bins, 1.0)), 0.0)
    cum_blogb = torch.cat([zero, blogb.cumsum(0)])

    k = torch.arange(q + 1, dtype=torch.int64)
    bounds = torch.div(k[None, :] * cand[:, None] + q - 1, q, rounding_mode="floor")  # ceil(k * i / Q)
    mass = cum[bounds[:, 1:]] - cum[bounds[:, :-1]]  # (K, Q) group masses over bins [0, i)
    size = nonzero[bounds[:, 1:]] - nonzero[bounds[:, :-1]]  # non-empty bins per group
    avg = torch.where(size > 0, mass / torch.where(size > 0, size, 1.0), 0.0)
    log_avg = torch.log(torch.where(avg > 0, avg, 1.0))
    group_term = (mass * log_avg).sum(dim=1)  # sum over j < i of b_j log avg(group(j))

    s_i = cum[cand]  # mass kept, = sum of Q_i before normalization
    last = bins[cand - 1]  # b_{i-1}
    tail = total - s_i
    last_group = torch.div((cand - 1) * q, cand, rounding_mode="floor")
    avg_last = avg.gather(1, last_group[:, None]).squeeze(1)
    log_avg_last = torch.log(torch.where(avg_last > 0, avg_last, 1.0))
    # terms j < i - 1: sum b_j/T * log((b_j/T) / (avg_j / S_i))
    head_blogb = cum_blogb[cand - 1]
    head_mass = cum[cand - 1]
    head_group = group_term - torch.where(last > 0, last * log_avg_last, 0.0)
    log_ratio = torch.log(s_i) - torch.log(total)
    head = (head_blogb - head_group + head_mass * log_ratio) / total
    # term j = i - 1 carries the tail
    p_last = (last + tail) / total
    q_last = avg_last / s_i
    last_term = torch.where(p_last > 0,
                            p_last * (torch.log(torch.where(p_last > 0, p_last, 1.0))
                                      - torch.log(torch.where(q_last > 0, q_last, 1.0))),
                            0.0)
    div = head + last_term
    div = torch.where((p_last > 0) & (last <= 0), torch.full_like(div, float("inf")), div)
    return cand, div


def entropy_threshold_bin(counts: torch.Tensor, num_quant_bins: int = 128, start_bin: int = 128,
                          stride: int = 1) -> int:
    """Number of bins i whose upper edge minimizes the KL divergence; ties go to the larger i."""
    cand, div = entropy_divergences(counts, num_quant_bins, start_bin, stride)
    best = div.min()
    if not torch.isfinite(best):
        return int(cand[-1])
    tol = 1e-12 * max(abs(float(best)), 1e-12)
    return int(cand[(div <= best + tol).nonzero().max()])


def percentile_bin(counts: torch.Tensor, percentile: float, *, tensorrt_cdf: bool = False) -> int:
    """Index of the bin holding the value of rank p/100 * total (TensorRT returns its lower edge);
    for p = 100 the number of bins (the last upper edge, i.e. the maximum).

    Cumulative counts are compared exactly, so the lower edge is within one bin width of the
    exact percentile.  `tensorrt_cdf=True` reproduces pytorch-quantization bit for bit instead:
    searchsorted on cumsum(hist / total), whose rounding can land just below p/100 over a run of
    empty bins and skip past them (at 99.99 % on randn(100000) by 21 bins).
    """
    if not 0.0 <= percentile <= 100.0:
        raise ConfigError(f"percentile must be in [0, 100], got {percentile}")
    counts = counts.to(torch.float64)
    if tensorrt_cdf:
        cdf = torch.cumsum(counts / counts.sum(), dim=0)
        target = torch.tensor([percentile / 100.0], dtype=torch.float64)
        return min(int(torch.searchsorted(cdf, target)[0]), counts.numel() - 1)
    if percentile >= 100.0:
        return counts.numel()  # the upper edge of the last bin: the maximum
    cum = torch.cumsum(counts, dim=0)
    target = torch.tensor([float(cum[-1]) * percentile / 100.0 * (1.0 - 1e-12)], dtype=torch.float64)
    return min(int(torch.searchsorted(cum, target)[0]), counts.numel() - 1)


def l2_range_bins(counts: torch.Tensor, dst_nbins: int = 256) -> tuple[int, int]:
    """torch.ao HistogramObserver's non-linear L2 search: the (start, end) bins to keep.

    Greedily moves the lower or upper cut by a quantile step of 1e-5 (whichever side moves
    more bins) while the L2 error of quantizing the histogram to `dst_nbins` levels over
    [start, end] drops; stops at the first increase.
    """
    bins = counts.numel()
    hist = counts.to(torch.float64)
    csum = torch.cumsum(hist, dim=0).tolist()
    total = csum[-1]
    src = torch.arange(bins, dtype=torch.float64)

    def error(start: int, end: int) -> float:
        # in units of the source bin width (torch.ao's error scaled by width^2, same argmin)
        dst_width = (end - start + 1) / dst_nbins
        begin = src - start
        end_ = begin + 1.0
        dst_begin = torch.clamp(torch.floor(begin / dst_width), 0, dst_nbins - 1)
        dst_end = torch.clamp(torch.floor(end_ / dst_width), 0, dst_nbins - 1)
        center_begin = (dst_begin + 0.5) * dst_width
        center_end = (dst_end + 0.5) * dst_width
        half = dst_width / 2

        def cube_diff(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
            return torch.as_tensor((b * b * b - a * a * a) / 3, dtype=torch.float64)

        norm = cube_diff(begin - center_begin, half)
        norm = norm + (dst_end - dst_begin - 1) * cube_diff(-half, half)
        norm = norm + cube_diff(-half, end_ - center_end)
        return float((hist * norm).sum())

    step = 1e-5
    alpha, beta = 0.0, 1.0
    start, end = 0, bins - 1
    best = float("inf")
    while alpha < beta:
        next_alpha, next_beta = alpha + step, beta - step
        left = bisect.bisect_left(csum, next_alpha * total, start, end)
        right = bisect.bisect_right(csum, next_beta * total, start + 1, end + 1) - 1
        next_start, next_end = start, end
        if (left - start) > (end - right):
            next_start = left
            alpha = next_alpha
        else:
            next_end = right
            beta = next_beta
        if next_start == start and next_end == end:
            continue
        norm = error(next_start, next_end)
        if norm > best:
            break
        best = norm
        start, end = next_start, next_end
    return start, end
