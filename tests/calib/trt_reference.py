"""A straightforward, loop-based re-statement of pytorch-quantization's histogram calibration.

Written from the published algorithm (pytorch_quantization/calib/histogram.py) to serve as the
reference in tests and as the "Python loop" peer in benchmarks/calibration.py.  Deliberately
unvectorized: one Python pass per candidate threshold, as the original.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import torch
from scipy.stats import entropy


def collect(batches: list[torch.Tensor], num_bins: int = 2048) -> tuple[np.ndarray, np.ndarray]:
    """|x| histogram as the torch_hist=True collector builds it: (int counts, float32 edges)."""
    hist = edges = None
    for x in batches:
        x = x.abs().float()
        x_max = x.max()
        if hist is None:
            hist = torch.histc(x, bins=num_bins, min=0, max=float(x_max))
            edges = torch.linspace(0, float(x_max), num_bins + 1)
        else:
            if x_max > edges[-1]:
                width = edges[1] - edges[0]
                num_bins = int((x_max / width).ceil().item())
                edges = torch.arange(0, float(x_max + width), float(width))
            new = torch.histc(x, bins=num_bins, min=0, max=float(edges[-1]))
            new[:hist.numel()] += hist
            hist = new
    assert hist is not None and edges is not None
    return hist.int().numpy(), edges.numpy()


def amax_entropy(calib_hist: np.ndarray, calib_bin_edges: np.ndarray, num_bits: int = 8,
                 unsigned: bool = False, stride: int = 1, start_bin: int = 128) -> float:
    """Threshold minimizing KL divergence, one candidate at a time."""
    bins = calib_hist.copy()
    bins[0] = bins[1]
    divergences = []
    nbins = 1 << (num_bits - 1 + int(unsigned))
    stop = len(bins)
    new_density_counts = np.zeros(nbins, dtype=np.float64)
    for i in range(start_bin, stop + 1, stride):
        new_density_counts.fill(0)
        space = np.linspace(0, i, num=nbins + 1)
        digitized_space = np.digitize(range(i), space) - 1
        digitized_space[bins[:i] == 0] = -1
        for idx, digitized in enumerate(digitized_space):
            if digitized != -1:
                new_density_counts[digitized] += bins[idx]
        counter = Counter(digitized_space)
        for key, val in counter.items():
            if key != -1:
                new_density_counts[key] = new_density_counts[key] / val
        new_density = np.zeros(i, dtype=np.float64)
        for idx, digitized in enumerate(digitized_space):
            if digitized != -1:
                new_density[idx] = new_density_counts[digitized]
        reference_density = np.array(bins[:len(digitized_space)], dtype=np.float64)
        reference_density[-1] += np.sum(bins[i:])
        divergences.append(entropy(reference_density, new_density))
    divergences_arr = np.array(divergences)
    last_argmin = len(divergences_arr) - 1 - np.argmin(divergences_arr[::-1])
    return float(calib_bin_edges[last_argmin * stride + start_bin])


def amax_percentile(calib_hist: np.ndarray, calib_bin_edges: np.ndarray, percentile: float) -> float:
    total = calib_hist.sum()
    cdf = np.cumsum(calib_hist / total)
    idx = np.searchsorted(cdf, percentile / 100)
    return float(calib_bin_edges[idx])


def amax_mse(calib_hist: np.ndarray, calib_bin_edges: np.ndarray, num_bits: int = 8, unsigned: bool = False,
             stride: int = 1, start_bin: int = 128) -> float:
    """Threshold (a bin center) minimizing the count-weighted squared error of fake quantization.

    fake_tensor_quant with narrow_range=True: scale = (2^(b-1+u) - 1) / amax,
    q = clamp(round(x * scale), -bound or 0, bound), x' = q / scale.
    """
    counts = torch.from_numpy(calib_hist).float()
    edges = torch.from_numpy(calib_bin_edges).float()
    centers = (edges[1:] + edges[:-1]) / 2
    bound = 2.0 ** (num_bits - 1 + int(unsigned)) - 1.0
    low = 0.0 if unsigned else -bound
    mses = []
    arguments = []
    for i in range(start_bin, len(centers), stride):
        amax = centers[i]
        scale = bound / amax
        quant = torch.clamp((centers * scale).round(), low, bound) / scale
        mses.append(float(((quant - centers) ** 2 * counts).mean()))
        arguments.append(i)
    return float(centers[arguments[int(np.argmin(mses))]])
