"""GPTQ (Frantar et al. 2023): block-wise weight quantization that compensates each column's rounding error on the
columns not yet quantized, using the input Hessian H = 2/n sum_t x_t x_t^T of the layer Y = X @ W.

For rows w (output channels) and input columns taken in order (or by descending diag(H) with `act_order`):
    H' = H + damp * mean(diag H) * I,   U = chol(H'^-1) (upper)
    q_j = Q(w_j),   e_j = (w_j - q_j) / U_jj,   w_{j+1..} -= e_j * U_{j, j+1..}
applied lazily over batches of columns. Each quantization block's scale and zero point are chosen when the walk
enters it, from the error-updated weights (clip search weighted by diag H); with `act_order` they are chosen up front
from the original weights (static groups), so the file needs no column permutation.
"""

from __future__ import annotations

import torch

from netquant.core.blockwise import (
    BlockQuantized,
    BlockSpec,
    pad_rows,
    quantize_clip_search,
)
from netquant.errors import DataError


def _group_params(cols: torch.Tensor, importance: torch.Tensor, spec: BlockSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale / zero point [N] of one quantization block, from its (updated) columns [N, block] (as a [block, N] weight)."""
    one = quantize_clip_search(cols.t(), spec, importance=importance)
    return one.scales[:, 0], one.zero_points[:, 0]


def quantize_gptq(weight: torch.Tensor, hessian: torch.Tensor, spec: BlockSpec, damp: float = 0.01,
                  act_order: bool = False, batch: int = 128, name: str = "weight") -> BlockQuantized:
    """GPTQ codes of `weight` [K, N] for input Hessian `hessian` [K, K] (module docstring)."""
    k, n = weight.shape
    if hessian.shape != (k, k):
        raise DataError(f"GPTQ {name}: Hessian shape {tuple(hessian.shape)} does not match K = {k}")
    b = spec.block_size
    w = pad_rows(weight.detach().to(torch.float64).t(), b)  # [N, Kp]
    kp = w.shape[1]
    h = torch.zeros(kp, kp, dtype=torch.float64)
    h[:k, :k] = hessian.to(torch.float64)
    dead = torch.diagonal(h) <= 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    diag = torch.diagonal(h).clone()
    n_groups = kp // b
    scales = torch.empty(n, n_groups, dtype=torch.float32)
    zeros = torch.empty(n, n_groups, dtype=torch.int32)
    if act_order:
        for g in range(n_groups):
            scales[:, g], zeros[:, g] = _group_params(w[:, g * b:(g + 1) * b].float(), diag[g * b:(g + 1) * b].float(), spec)
        perm = torch.argsort(diag, descending=True, stable=True)
    else:
        perm = torch.arange(kp)
    w = w[:, perm]
    h = h[perm][:, perm]
    h += damp * torch.mean(torch.diagonal(h)) * torch.eye(kp, dtype=torch.float64)
    u = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    codes = torch.zeros(n, kp, dtype=torch.float64)
    batch = max(b, (batch // b) * b)
    for i1 in range(0, kp, batch):
        i2 = min(i1 + batch, kp)
        w1 = w[:, i1:i2].clone()
        err1 = torch.zeros_like(w1)
        u1 = u[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // b
            if not act_order and col % b == 0:
                scales[:, g], zeros[:, g] = _group_params(w1[:, i:i + b].float(), diag[col:col + b].float(), spec)
            s, z = scales[:, g].double(), zeros[:, g].double()
            q = (torch.round(w1[:, i] / s) + z).clamp(0, spec.levels)
            codes[:, i1 + i] = q
            e = (w1[:, i] - (q - z) * s) / u1[i, i]
            w1[:, i:] -= e.unsqueeze(1) * u1[i, i:].unsqueeze(0)
            err1[:, i] = e
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    inverse = torch.argsort(perm)
    codes = codes[:, inverse]
    return BlockQuantized(codes.to(torch.uint8), scales, zeros, k, spec)
