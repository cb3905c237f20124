"""AWQ (Lin et al. 2024): activation-aware per-input-channel scaling before weight-only quantization.

For the MatMuls Y_i = X @ W_i that read one activation X [T, K], with a = mean_t |x_tk| per channel:
    s(alpha) = a^alpha / sqrt(max(a^alpha) * min(a^alpha)),   alpha in linspace(0, 1, grid)
    err(alpha) = sum_i || (X / s) @ Q(diag(s) W_i) - X @ W_i ||^2
The alpha with the lowest error wins (alpha = 0: plain RTN); the activation is divided by s (folded into its producer
or an explicit Mul) and each diag(s) W_i keeps the RTN codes the search measured (a clip search on top, weighted by the
scaled activations, raised perplexity on the trained decoder of benchmarks/llm.py: +0.0019 / +0.0061 vs -0.0004 /
+0.0031 at block 32 / 128).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from netquant.core.blockwise import BlockQuantized, BlockSpec, quantize_rtn


@dataclass
class AwqResult:
    """Per-channel scale s [K] (divide the activation by it), the chosen alpha, and each weight's codes of diag(s) W."""

    scale: torch.Tensor
    alpha: float
    quantized: list[BlockQuantized]
    error: float
    error_plain: float


def _output_error(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, spec: BlockSpec) -> float:
    xs = x / s
    total = 0.0
    for w in weights:
        ref = x @ w
        wq = quantize_rtn(w * s.unsqueeze(1), spec).dequantize()
        total += float(((xs @ wq - ref) ** 2).sum())
    return total


def awq_search(x: torch.Tensor, weights: list[torch.Tensor], spec: BlockSpec, grid: int = 20) -> AwqResult:
    """The AWQ scale for activation samples `x` [T, K] and weights [K, N_i] (module docstring)."""
    x = x.to(torch.float32)
    weights = [w.detach().to(torch.float32) for w in weights]
    a = x.abs().mean(0).clamp_min(1e-8)
    ones = torch.ones_like(a)
    plain = _output_error(x, weights, ones, spec)
    best_err, best_alpha, best_s = plain, 0.0, ones
    for alpha in torch.linspace(0.0, 1.0, grid + 1)[1:].tolist():
        s = a.pow(alpha)
        s = s / torch.sqrt(s.max() * s.min())
        err = _output_error(x, weights, s, spec)
        if err < best_err:
            best_err, best_alpha, best_s = err, alpha, s
    quantized = [quantize_rtn(w * best_s.unsqueeze(1), spec) for w in weights]
    return AwqResult(best_s, best_alpha, quantized, best_err, plain)
