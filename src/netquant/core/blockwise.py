"""Block-wise weight quantization for weight-only formats (ONNX `MatMulNBits`, opset-21 blocked DequantizeLinear).

Layout: a MatMul weight W of shape [K, N] (Y = X @ W) is handled as its transpose, rows = the N output channels,
each row cut into ceil(K / block_size) blocks along K; the last block is zero-padded. Per block b of row n:

    symmetric (signed codes in [-2^(bits-1), 2^(bits-1) - 1], stored with offset zp = 2^(bits-1)):
        s = amax / (2^(bits-1) - 1) if the extreme value is positive, amax / 2^(bits-1) if it is negative
        (so the extreme value lands on a code exactly and the extra negative code is used)
    asymmetric (codes in [0, 2^bits - 1]):
        lo = min(min(w), 0), hi = max(max(w), 0), s = (hi - lo) / (2^bits - 1), zp = clamp(round(-lo / s))
    q = clamp(round(w / s) + zp, 0, 2^bits - 1),   w ~ (q - zp) * s

Stored codes are unsigned (as MatMulNBits reads them); `dequantize` gives the float weights an engine computes with.
All-zero blocks get s = 1 (any positive scale codes zero exactly). `quantize_rtn` applies these rules; `quantize_hqq`
starts from the asymmetric ones and moves each block's scale and zero point (half-quadratic l_p fit);
`quantize_clip_search` shrinks the range (GPTQ's column groups). RTN and HQQ run in numpy over cache-sized steps.
"""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from netquant.errors import ConfigError

_CHUNK = 1 << 17  # float32 elements per step of the fused RTN loop (512 KB: its passes stay in the core's L2 cache)


class WeightOnlyFormat(enum.Enum):
    """How block-quantized weights are written to ONNX."""

    MATMUL_NBITS = "matmulnbits"  # com.microsoft.MatMulNBits / GatherBlockQuantized: onnxruntime's weight-only kernels
    BLOCKED_DQ = "dq"             # opset-21 blocked DequantizeLinear + MatMul / Gather: any engine that reads int4 DQ


@dataclass(frozen=True)
class BlockSpec:
    """Weight-only format: `bits` (4 or 8), `block_size` (a power of two, 16..256 for MatMulNBits), symmetric or not."""

    bits: int = 4
    block_size: int = 128
    symmetric: bool = True

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ConfigError(f"weight-only bits={self.bits}: use 4 or 8")
        if self.block_size < 16 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"weight-only block_size={self.block_size}: use a power of two >= 16 (16..256)")

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def offset(self) -> int:
        """Zero point of symmetric codes (8 for 4 bits, 128 for 8 bits)."""
        return 1 << (self.bits - 1)

    def blocks(self, k: int) -> int:
        return math.ceil(k / self.block_size)


@dataclass
class BlockQuantized:
    """Codes [N, n_blocks * block_size] (uint8 values in [0, 2^bits - 1], padded along K), scales and zero points
    [N, n_blocks] (float32 / int32), and the unpadded K."""

    codes: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor
    k: int
    spec: BlockSpec
    known_mse: float | None = None  # mse() of the weight it was quantized from, when the quantizer computed it

    def dequantize(self) -> torch.Tensor:
        """The float weight [K, N] the engine computes with: (q - zp) * s per block."""
        n, kp = self.codes.shape
        b = self.spec.block_size
        q = self.codes.reshape(n, kp // b, b).to(torch.float32)
        w = (q - self.zero_points.unsqueeze(-1).to(torch.float32)) * self.scales.unsqueeze(-1)
        return w.reshape(n, kp)[:, : self.k].t().contiguous()

    def mse(self, weight: torch.Tensor) -> float:
        """mean((dequantize() - weight)^2) over the [K, N] `weight`, dequantized in the weight's own layout (only the
        uint8 codes are transposed: a float difference across layouts reads memory with a stride and is many times
        slower)."""
        n, kp = self.codes.shape
        b = self.spec.block_size
        d = self.codes.t().contiguous().to(torch.float32).reshape(kp // b, b, n)
        d.sub_(self.zero_points.t().to(torch.float32).unsqueeze(1)).mul_(self.scales.t().unsqueeze(1))
        d = d.reshape(kp, n)[: self.k].sub_(weight.detach().to(torch.float32))
        return float(d.pow_(2).mean())


def pad_rows(wt: torch.Tensor, block_size: int) -> torch.Tensor:
    """Rows [N, K] zero-padded along K to a multiple of block_size."""
    k = wt.shape[1]
    pad = (-k) % block_size
    return torch.nn.functional.pad(wt, (0, pad)) if pad else wt


def block_range(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each block's (min, max) of `blocks` [..., block_size] in float32: computed once, shared by every clip ratio."""
    lo, hi = torch.aminmax(blocks.to(torch.float32), dim=-1)  # one pass over the blocks
    return lo, hi


def params_from_range(lo: torch.Tensor, hi: torch.Tensor, spec: BlockSpec, clip: torch.Tensor | float = 1.0
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of blocks with min `lo` and max `hi` (module docstring's RTN rule), the range shrunk by
    `clip` (a factor in (0, 1], scalar or one per block)."""
    if spec.symmetric:
        amax = torch.maximum(hi, -lo) * clip
        scale = torch.where(-lo > hi, amax / spec.offset, amax / (spec.offset - 1))
        zero = torch.full_like(scale, spec.offset, dtype=torch.int32)
    else:
        lo = lo.clamp(max=0) * clip
        hi = hi.clamp(min=0) * clip
        scale = (hi - lo) / spec.levels
        safe = torch.where(scale > 0, scale, torch.ones_like(scale))
        zero = torch.round(-lo / safe).clamp(0, spec.levels).to(torch.int32)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, zero


def block_params(blocks: torch.Tensor, spec: BlockSpec, clip: torch.Tensor | float = 1.0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point of each block of `blocks` [..., block_size] (module docstring's RTN rule), with the range
    shrunk by `clip` (a factor in (0, 1], scalar or one per block)."""
    lo, hi = block_range(blocks)
    return params_from_range(lo, hi, spec, clip)


def quantize_blocks(blocks: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: BlockSpec) -> torch.Tensor:
    """Codes q = clamp(round(w / s) + zp, 0, 2^bits - 1) of `blocks` [..., block_size] (round half to even)."""
    q = torch.div(blocks, scale.unsqueeze(-1)).round_()  # in place from here: one temporary
    q.add_(zero.unsqueeze(-1).to(torch.float32))
    return q.clamp_(0, spec.levels)


def dequantize_blocks(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return (codes - zero.unsqueeze(-1).to(torch.float32)) * scale.unsqueeze(-1)


def _finish(wt_blocks: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, k: int, spec: BlockSpec
            ) -> BlockQuantized:
    codes = quantize_blocks(wt_blocks, scale, zero, spec)
    n = wt_blocks.shape[0]
    return BlockQuantized(codes.reshape(n, -1).to(torch.uint8), scale.to(torch.float32), zero.to(torch.int32), k, spec)


def quantize_rtn(weight: torch.Tensor | np.ndarray, spec: BlockSpec, threads: int = 1) -> BlockQuantized:
    """Round to nearest with the block min / max (module docstring). `weight` is [K, N] (a tensor or a numpy array,
    read only). One fused pass over the weight in ~512 KB steps of whole blocks (range, scale, codes, squared error;
    each step stays in cache) in numpy, the steps shared by `threads` threads (numpy releases the GIL; no fork-join per
    op, so a busy machine does not stall it). Same codes for any thread count. The result carries `known_mse` (what
    `mse(weight)` gives). Non-finite weights give non-finite scales (the caller checks)."""
    return _by_steps(weight, spec, threads, _rtn_step)


StepFn = Callable[[np.ndarray, BlockSpec, tuple[int, int, int, int], np.ndarray, np.ndarray, np.ndarray], float]


def _by_steps(weight: torch.Tensor | np.ndarray, spec: BlockSpec, threads: int, step_fn: StepFn) -> BlockQuantized:
    """Run `step_fn` over cache-sized steps (~_CHUNK elements: whole blocks along K, and column ranges of wide
    weights) of `weight` [K, N], the steps shared by `threads` threads, each writing its part of codes [N, Kp],
    scales and zeros [n_blocks, N] and returning its squared error; the errors are summed in step order (the same
    result for any thread count)."""
    w = weight.detach().cpu().numpy() if isinstance(weight, torch.Tensor) else np.asarray(weight)
    if w.dtype != np.float32:
        w = w.astype(np.float32)
    k, n = w.shape
    b = spec.block_size
    nb = -(-k // b)
    codes = np.empty((n, nb * b), dtype=np.uint8)
    scales = np.empty((nb, n), dtype=np.float32)
    zeros = np.empty((nb, n), dtype=np.int32)
    rows = max(1, _CHUNK // (b * n))  # blocks (along K) per step
    width = n if rows > 1 else max(1, min(n, _CHUNK // b))  # columns per step (wide weights: lm_head)
    steps = [(i, min(nb, i + rows), c0, min(n, c0 + width)) for i in range(0, nb, rows) for c0 in range(0, n, width)]

    def run(part: list[tuple[int, int, int, int]]) -> list[float]:
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):  # non-finite weights: the caller checks
            return [step_fn(w, spec, step, codes, scales, zeros) for step in part]

    if threads > 1 and len(steps) > 1:
        share = -(-len(steps) // min(threads, len(steps)))
        parts = [steps[i:i + share] for i in range(0, len(steps), share)]
        sq_steps = [x for got in _pool(len(parts)).map(run, parts) for x in got]
    else:
        sq_steps = run(steps)
    return BlockQuantized(torch.from_numpy(codes), torch.from_numpy(np.ascontiguousarray(scales.T)),
                          torch.from_numpy(np.ascontiguousarray(zeros.T)), k, spec,
                          math.fsum(sq_steps) / max(1, k * n))


_POOLS: dict[int, ThreadPoolExecutor] = {}


def _pool(workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of `workers` threads (made once, reused by every call)."""
    if workers not in _POOLS:
        _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="netquant-rtn")
    return _POOLS[workers]


def _rtn_step(w: np.ndarray, spec: BlockSpec, step: tuple[int, int, int, int], codes: np.ndarray,
              scales: np.ndarray, zeros: np.ndarray) -> float:
    """RTN of blocks i..j (along K) of columns c0..c1 of `w` [K, N], written into codes [N, Kp] (transposed), scales
    and zeros [n_blocks, N]; returns the step's sum of squared errors."""
    i, j, c0, c1 = step
    b, k = spec.block_size, w.shape[0]
    part = w[i * b: min(k, j * b), c0:c1]
    if part.shape[0] < (j - i) * b:  # the last block is zero-padded
        part = np.concatenate([part, np.zeros(((j - i) * b - part.shape[0], c1 - c0), np.float32)])
    cols = part.reshape(j - i, b, c1 - c0)
    scale, zero = _params_np(cols.min(1), cols.max(1), spec)
    t = cols / scale[:, None, :]  # w / s
    q = np.rint(t)
    zf = zero.astype(np.float32)[:, None, :]
    q += zf
    np.clip(q, 0, spec.levels, out=q)
    t += zf
    t -= q  # (w - w^) / s
    t *= t
    codes[c0:c1, i * b: j * b] = q.reshape((j - i) * b, c1 - c0).astype(np.uint8).T
    scales[i:j, c0:c1] = scale
    zeros[i:j, c0:c1] = zero
    return float(np.einsum("ij,ij->", t.sum(1, dtype=np.float64), scale.astype(np.float64) ** 2))


def _params_np(lo: np.ndarray, hi: np.ndarray, spec: BlockSpec) -> tuple[np.ndarray, np.ndarray]:
    """`params_from_range` (clip 1) in numpy: scale (float32, 1 for all-zero blocks) and zero point (int32)."""
    if spec.symmetric:
        amax = np.maximum(hi, -lo)
        scale = np.where(-lo > hi, amax / np.float32(spec.offset), amax / np.float32(spec.offset - 1))
        zero = np.full(scale.shape, spec.offset, dtype=np.int32)
    else:
        lo = np.minimum(lo, 0)
        hi = np.maximum(hi, 0)
        scale = (hi - lo) / np.float32(spec.levels)
        safe = np.where(scale > 0, scale, np.float32(1))
        zero = np.clip(np.rint(-lo / safe), 0, spec.levels).astype(np.int32)
    scale = np.where(scale == 0, np.float32(1), scale).astype(np.float32)  # NaN stays NaN (caller checks)
    return scale, zero


def quantize_clip_search(weight: torch.Tensor, spec: BlockSpec, grid: int = 20, min_ratio: float = 0.5,
                         importance: torch.Tensor | None = None) -> BlockQuantized:
    """RTN with each block's range shrunk by the clip ratio c in linspace(1, min_ratio, grid) that minimizes the block's
    squared error sum_k imp_k (w_k - w^_k)^2; `importance` [K] weights the input channels (e.g. mean x_k^2), 1 if None.
    (Row layout: GPTQ calls it on small column groups.)"""
    wt = pad_rows(weight.detach().to(torch.float32).t(), spec.block_size)
    n = wt.shape[0]
    blocks = wt.reshape(n, -1, spec.block_size)
    imp = None if importance is None else \
        pad_rows(importance.reshape(1, -1).to(torch.float32), spec.block_size).reshape(1, -1, spec.block_size)
    lo, hi = block_range(blocks)
    best_scale, best_zero = params_from_range(lo, hi, spec)
    best_err = _block_error(blocks, best_scale, best_zero, spec, imp)
    for ratio in torch.linspace(1.0, min_ratio, grid).tolist()[1:]:
        scale, zero = params_from_range(lo, hi, spec, ratio)
        err = _block_error(blocks, scale, zero, spec, imp)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_zero = torch.where(better, zero, best_zero)
    return _finish(blocks, best_scale, best_zero, weight.shape[0], spec)


def _block_error(blocks: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, spec: BlockSpec,
                 imp: torch.Tensor | None) -> torch.Tensor:
    """sum_k imp_k (w_k - w^_k)^2 per block (imp = 1 when None)."""
    d = dequantize_blocks(quantize_blocks(blocks, scale, zero, spec), scale, zero) - blocks
    d = d * d
    return (d if imp is None else d * imp).sum(-1)


def quantize_hqq(weight: torch.Tensor | np.ndarray, spec: BlockSpec, iters: int = 5, p: float = 0.7,
                 beta: float = 10.0, kappa: float = 1.01, threads: int = 1) -> BlockQuantized:
    """Half-quadratic quantization (HQQ, Badri & Shaji 2023): asymmetric codes whose per-block scale and integer zero
    point are fitted to a sparsity-promoting l_p (p < 1) error, so a few large rounding errors do not set the block.

    HQQ is asymmetric by construction (it moves the zero point): `spec.symmetric` is ignored and the result has
    per-block zero points. Per block, start from asymmetric RTN (range [min(w, 0), max(w, 0)]): scale s, zero point z.
    With u = w / s (the weights in code units, where the shrinkage threshold means the same for every block) and
    beta_0 = `beta`, each iteration (half-quadratic splitting of min ||w - w^||_p^p with the extra variable e):
        q  = clamp(round(u + z), 0, 2^bits - 1),   r = u - (q - z)           (the error in code units)
        e  = sign(r) max(|r| - |r|^(p-1) / beta, 0)                          (proximal step of the l_p term)
        z  = clamp(round(mean(q - (u - e))), 0, 2^bits - 1)                   (closed form, kept integer)
        s  = <w - e s, q - z> / <q - z, q - z>                                (least squares for the codes)
        beta *= kappa
    Each block keeps the (s, z) with the lowest sum |w - w^| it met (the start included: never worse than asymmetric
    RTN in that measure) and stops once that error no longer falls (HQQ's stop, per block). Numpy over cache-sized
    steps of blocks, all iterations of a step while it is in cache, the steps shared by `threads` threads: the same
    codes for any thread count. `weight` is [K, N]; the result carries `known_mse`."""
    options = (iters, p, beta, kappa)

    def step_fn(w: np.ndarray, spec: BlockSpec, step: tuple[int, int, int, int], codes: np.ndarray,
                scales: np.ndarray, zeros: np.ndarray) -> float:
        return _hqq_step(w, spec, step, codes, scales, zeros, options)

    return _by_steps(weight, BlockSpec(spec.bits, spec.block_size, False), threads, step_fn)


def _hqq_step(w: np.ndarray, spec: BlockSpec, step: tuple[int, int, int, int], codes: np.ndarray,
              scales: np.ndarray, zeros: np.ndarray, opts: tuple[int, float, float, float]) -> float:
    """`quantize_hqq` of blocks i..j (along K) of columns c0..c1 of `w` [K, N] (outputs as in `_rtn_step`); returns the
    step's sum of squared errors."""
    iters, p, beta, kappa = opts
    i, j, c0, c1 = step
    b, k, levels = spec.block_size, w.shape[0], np.float32(spec.levels)
    part = w[i * b: min(k, j * b), c0:c1]
    if part.shape[0] < (j - i) * b:
        part = np.concatenate([part, np.zeros(((j - i) * b - part.shape[0], c1 - c0), np.float32)])
    cols = part.reshape(j - i, b, c1 - c0)
    scale, zero = _params_np(cols.min(1), cols.max(1), spec)
    z = zero.astype(np.float32)
    best_s, best_z, best_err = scale, z, np.full(z.shape, np.inf, np.float32)
    active = np.ones(z.shape, dtype=bool)
    for _ in range(iters):
        s3, z3 = scale[:, None, :], z[:, None, :]
        u = cols / s3  # the weights in code units
        q = u + z3
        np.rint(q, out=q)
        np.clip(q, 0, levels, out=q)
        c = q - z3  # centered codes
        r = u - c  # the error in code units
        mag = np.abs(r)
        err = mag.sum(1) * scale  # sum |w - w^| per block
        better = (err < best_err) & active
        active = better  # HQQ's stop: a block whose error no longer falls is done
        best_err = np.where(better, err, best_err)
        best_s = np.where(better, scale, best_s)
        best_z = np.where(better, z, best_z)
        if not active.any():
            break
        # e = sign(r) max(|r| - |r|^(p-1) / beta, 0): the error's sparse part; w - e s is what the codes should give
        e = np.power(mag + np.float32(1e-8), np.float32(p - 1))
        e *= np.float32(1.0 / beta)
        np.subtract(mag, e, out=e)
        np.maximum(e, 0, out=e)
        np.copysign(e, r, out=e)
        np.subtract(u, e, out=e)  # (w - e s) / s
        new_z = np.clip(np.rint((q - e).mean(1)), 0, levels)
        c = q - new_z[:, None, :]
        den = (c * c).sum(1)
        e *= s3  # w - e s
        new_s = (e * c).sum(1) / np.where(den > 0, den, np.float32(1))
        z = np.where(active, new_z, z)
        scale = np.where(active & (den > 0) & (new_s > 0), new_s, scale).astype(np.float32)
        beta *= kappa
    s3 = best_s[:, None, :]
    zero = best_z.astype(np.int32)
    q = cols / s3
    q += best_z[:, None, :]
    np.rint(q, out=q)
    np.clip(q, 0, levels, out=q)
    d = q - best_z[:, None, :]
    d *= s3
    d -= cols
    d *= d
    codes[c0:c1, i * b: j * b] = q.reshape((j - i) * b, c1 - c0).astype(np.uint8).T
    scales[i:j, c0:c1] = best_s
    zeros[i:j, c0:c1] = zero
    return float(np.einsum("ij->", d.sum(1, dtype=np.float64)))


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., K] (K even for 4 bits) packed as MatMulNBits / ONNX int4 store them: two 4-bit codes a byte,
    the first in the low nibble. 8-bit codes are returned as they are."""
    codes = codes.to(torch.uint8)
    if bits == 8:
        return codes
    if codes.shape[-1] % 2:
        codes = torch.nn.functional.pad(codes, (0, 1))
    if sys.byteorder != "little":
        return codes[..., 0::2] | (codes[..., 1::2] << 4)
    # each pair (lo, hi) read as one little-endian uint16 v = lo + 256 hi: the low byte of v | v >> 4 is lo | hi << 4
    v = np.ascontiguousarray(codes.numpy()).view(np.uint16)
    return torch.from_numpy((v | (v >> 4)).astype(np.uint8))


def unpack_codes(packed: torch.Tensor, bits: int, k: int) -> torch.Tensor:
    """Inverse of `pack_codes`: the first k codes of each row."""
    if bits == 8:
        return packed[..., :k]
    low, high = packed & 0x0F, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1)[..., :k]
