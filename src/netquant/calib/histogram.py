"""Streaming, mergeable, memory-bounded histograms, one per channel, batched.

Every channel c has a uniform grid of width w_c anchored at 0: bin k holds the values v with
floor(v / w_c) = k (computed in float32, which reproduces torch.histc's binning exactly).
`counts[c, j]` is bin k = first_c + j, for j < nbins_c.  Abs histograms (`signed=False`)
count |x| and always start at k = 0; signed ones count x.

Two grid rules:

* `GridMode.TENSORRT` (default, pytorch-quantization / TensorRT): the first non-zero batch
  sets w = max / num_bins (num_bins bins over [0, max], max itself in the last bin); later
  batches grow the range by appending bins of the same width.  If the range would need more
  than `max_bins` bins, adjacent bins are summed by an integer factor (memory stays bounded).
  Merging histograms of different widths redistributes the other's counts by linear
  interpolation of its cumulative counts (exact when the widths agree).
* `GridMode.POW2`: w = the smallest power of two with span / w <= num_bins, span being the
  largest |x| seen (abs) or max - min (signed).  The histogram then depends only on the set of
  values seen, not on their order or batching, and merging is exact.

Values that are exactly 0 seen before any non-zero value are held in `pending_zeros` and
placed in bin 0 once the grid exists.
"""

from __future__ import annotations

import enum
import math

import torch

from netquant.errors import ConfigError

_INF = float("inf")


class GridMode(enum.Enum):
    """How a histogram chooses and grows its bin width."""

    TENSORRT = "tensorrt"
    POW2 = "pow2"


def _pow2_at_least(q: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= q, elementwise (float64, q > 0)."""
    mant, expo = torch.frexp(q)  # q = mant * 2^expo, mant in [0.5, 1)
    expo = torch.where(mant == 0.5, expo - 1, expo)
    return torch.ldexp(torch.ones_like(q), expo)


class Histogram:
    """C histograms on aligned uniform grids (see module docstring)."""

    def __init__(self, num_bins: int = 2048, *, signed: bool = False, grid: GridMode = GridMode.TENSORRT,
                 max_bins: int | None = None) -> None:
        if num_bins < 2:
            raise ConfigError(f"histogram needs num_bins >= 2, got {num_bins}")
        self.num_bins = int(num_bins)
        self.signed = signed
        self.grid = GridMode(grid)
        self.max_bins = int(max_bins) if max_bins is not None else 4 * self.num_bins
        if self.max_bins < self.num_bins + 1:
            raise ConfigError(f"histogram max_bins ({self.max_bins}) must exceed num_bins ({self.num_bins})")
        self.channels = 0
        self.width = torch.zeros(0, dtype=torch.float64)  # 0 = no grid yet
        self.first = torch.zeros(0, dtype=torch.int64)
        self.nbins = torch.zeros(0, dtype=torch.int64)
        self.counts = torch.zeros(0, 0, dtype=torch.float64)
        self.pending_zeros = torch.zeros(0, dtype=torch.float64)
        self.vmin = torch.zeros(0)  # finite extrema seen (float32), of |x| for abs histograms
        self.vmax = torch.zeros(0)

    # ---- state ----------------------------------------------------------------------
    def _allocate(self, channels: int) -> None:
        self.channels = channels
        self.width = torch.zeros(channels, dtype=torch.float64)
        self.first = torch.zeros(channels, dtype=torch.int64)
        self.nbins = torch.zeros(channels, dtype=torch.int64)
        self.counts = torch.zeros(channels, 0, dtype=torch.float64)
        self.pending_zeros = torch.zeros(channels, dtype=torch.float64)
        self.vmin = torch.full((channels,), _INF)
        self.vmax = torch.full((channels,), -_INF)

    @property
    def initialized(self) -> torch.Tensor:
        """(C,) bool: channels that have a grid."""
        return self.width > 0

    def total(self) -> torch.Tensor:
        """(C,) float64: values counted per channel."""
        return self.counts.sum(dim=1) + self.pending_zeros

    def channel(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(counts, edges) of channel c: float64 tensors of n and n + 1 entries.

        A channel that only saw zeros gives one bin [0, 0] holding them.
        """
        if not bool(self.initialized[c]):
            return self.pending_zeros[c:c + 1].clone(), torch.zeros(2, dtype=torch.float64)
        n = int(self.nbins[c])
        k = self.first[c] + torch.arange(n + 1, dtype=torch.int64)
        edges = (k.to(torch.float64) * self.width[c]).float().double()
        return self.counts[c, :n].clone(), edges

    # ---- observing ------------------------------------------------------------------
    def add(self, values: torch.Tensor, finite: torch.Tensor | None, cmin: torch.Tensor,
            cmax: torch.Tensor) -> None:
        """Count a (C, N) float32 batch; `cmin`/`cmax` are its per-channel finite extrema."""
        channels = values.shape[0]
        if self.channels == 0:
            self._allocate(channels)
        if self.signed:
            lo, hi = cmin, cmax
        else:
            lo = torch.zeros_like(cmin)
            hi = torch.maximum(cmin.abs(), cmax.abs())
            hi = torch.where(torch.isfinite(cmin), hi, torch.full_like(hi, -_INF))
        has = torch.isfinite(hi)
        self.vmin = torch.where(has, torch.minimum(self.vmin, lo), self.vmin)
        self.vmax = torch.where(has, torch.maximum(self.vmax, hi), self.vmax)
        if not self._covered():
            self._fit_grid(has)
        if finite is None and not bool(self.initialized.all()):
            finite = torch.ones_like(values, dtype=torch.bool)
        if finite is not None:
            # values of channels still without a grid are all zeros: hold them aside
            waiting = ~self.initialized
            if bool(waiting.any()):
                self.pending_zeros += torch.where(waiting[:, None], finite, False).sum(dim=1).double()
                finite = finite & self.initialized[:, None]
        self._count(values, finite)

    def _covered(self) -> bool:
        """True when every channel has a grid whose bins already hold [vmin, vmax] (fast path)."""
        if self.channels == 0 or not bool(self.initialized.all()):
            return False
        w32 = self.width.float()
        last = self.first + self.nbins - 1
        seen = torch.isfinite(self.vmax)
        if self.grid is GridMode.TENSORRT and not self.signed:
            top = torch.ceil(self.vmax / w32).to(torch.int64) - 1
        else:
            top = torch.floor(self.vmax / w32).to(torch.int64)
        ok = top <= last
        if self.signed:
            ok &= torch.floor(self.vmin / w32).to(torch.int64) >= self.first
        if self.grid is GridMode.POW2:  # the width must also still be the one for this range
            ok &= self._target_width(seen) == self.width
        return bool((ok | ~seen).all())

    def _target_width(self, has: torch.Tensor) -> torch.Tensor:
        """Grid width per channel for the range [vmin, vmax] seen so far (0 = no grid yet)."""
        lo, hi = self.vmin.double(), self.vmax.double()
        amax = torch.maximum(lo.abs(), hi.abs())
        nonzero = has & (amax > 0)
        span = (hi - lo) if self.signed else amax
        span = torch.where(nonzero & (span > 0), span, torch.where(nonzero, amax, 1.0))
        if self.grid is GridMode.POW2:
            target = _pow2_at_least(span / self.num_bins)
            return torch.where(nonzero, torch.maximum(self.width, target), self.width)
        init = (span.float() / self.num_bins).double()
        return torch.where(nonzero & (self.width == 0), init, self.width)

    def _fit_grid(self, has: torch.Tensor) -> None:
        """Create or grow each channel's grid so it covers [vmin, vmax]."""
        width = self._target_width(has)
        self._regrid(*self._bounded_cover(width))

    def _bounded_cover(self, width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(width, first, last) covering the range; TensorRT grids needing more than max_bins bins
        get their width multiplied by an integer (adjacent bins summed) back to ~num_bins bins."""
        first, last = self._cover(width)
        if self.grid is GridMode.TENSORRT:
            size = last - first + 1
            factor = torch.where(size > self.max_bins,
                                 torch.ceil(size.double() / self.num_bins).to(torch.int64), 1)
            if bool((factor > 1).any()):
                width = torch.where(factor > 1, (width * factor).float().double(), width)
                first, last = self._cover(width)
        return width, first, last

    def _cover(self, width: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """First and last bin index per channel for grid `width` to hold [vmin, vmax] and the old bins."""
        has_grid = width > 0
        w32 = torch.where(has_grid, width, 1.0).float()
        seen = torch.isfinite(self.vmax) & has_grid
        lo = torch.where(seen, self.vmin, 0.0)
        hi = torch.where(seen, self.vmax, 0.0)
        if self.signed:
            need_first = torch.floor(lo / w32).to(torch.int64)
        else:
            need_first = torch.zeros_like(self.first)
        if self.grid is GridMode.TENSORRT and not self.signed:
            # TensorRT: num_bins bins over [0, max] with max in the last bin; grows to ceil(max / w) bins
            need_last = (torch.ceil(hi / w32).to(torch.int64) - 1).clamp(min=0)
        else:
            need_last = torch.floor(hi / w32).to(torch.int64)
        first, last = need_first, need_last
        if self.grid is GridMode.TENSORRT:  # keep the bins already there (POW2 grids follow the range only)
            old = self.initialized
            factor = torch.round(width / torch.where(old, self.width, 1.0)).to(torch.int64).clamp(min=1)
            old_first = torch.div(self.first, factor, rounding_mode="floor")
            old_last = torch.div(self.first + self.nbins - 1, factor, rounding_mode="floor")
            first = torch.where(old, torch.minimum(first, old_first), first)
            last = torch.where(old, torch.maximum(last, old_last), last)
        first = torch.where(has_grid, first, 0)
        last = torch.where(has_grid, last, -1)
        return first, last

    def _regrid(self, width: torch.Tensor, first: torch.Tensor, last: torch.Tensor) -> None:
        """Move counts onto grids (width, first..last); old widths must divide the new ones."""
        nbins = (last - first + 1).clamp(min=0)
        if torch.equal(width, self.width) and torch.equal(first, self.first) and torch.equal(nbins, self.nbins):
            return
        cols = int(nbins.max()) if nbins.numel() else 0
        counts = torch.zeros(self.channels, cols, dtype=torch.float64)
        if self.counts.numel():
            old_cols = self.counts.shape[1]
            j = torch.arange(old_cols, dtype=torch.int64)
            k = self.first[:, None] + j[None, :]
            factor = torch.round(width / torch.where(self.width > 0, self.width, 1.0)).to(torch.int64).clamp(min=1)
            k_new = torch.div(k, factor[:, None], rounding_mode="floor") - first[:, None]
            valid = (j[None, :] < self.nbins[:, None]) & (self.width[:, None] > 0)
            k_new = k_new.clamp(0, max(cols - 1, 0))
            flat = (torch.arange(self.channels)[:, None] * cols + k_new)[valid]
            counts.view(-1).index_add_(0, flat, self.counts[valid])
        self.width, self.first, self.nbins, self.counts = width, first, nbins, counts
        self._flush_pending()

    def _flush_pending(self) -> None:
        """Zeros held aside go to the bin holding 0 once a channel has a grid."""
        rows = torch.nonzero(self.initialized & (self.pending_zeros > 0)).flatten()
        if rows.numel():
            self.counts[rows, (-self.first[rows]).clamp(min=0)] += self.pending_zeros[rows]
            self.pending_zeros[rows] = 0.0

    def _count(self, values: torch.Tensor, finite: torch.Tensor | None) -> None:
        """Bin a (C, N) batch: k = floor(v / w) (v = |x| for abs histograms), in float32 like
        torch.histc, clamped to the channel's bins; counted with one int32 bincount."""
        channels, cols = self.counts.shape
        if cols == 0:
            return
        if channels * cols >= 1 << 24:  # offsets no longer exact in float32
            self._count_wide(values, finite)
            return
        # scratch buffers are reused across batches: fresh multi-MB tensors per batch cost page faults
        t = self._scratch("_buf_f", values.shape, torch.float32)
        if channels == 1:
            torch.div(values, self.width.float(), out=t)
        else:
            torch.div(values, self.width.float().where(self.initialized, 1.0)[:, None], out=t)
        if self.signed:
            t.floor_()
            t -= self.first.float().view(-1, 1) if channels > 1 else float(self.first[0])
        else:
            t.abs_()
        if channels == 1:
            t.clamp_(0, float(self.nbins[0] - 1))
        else:
            t.clamp_(min=0)
            torch.minimum(t, (self.nbins - 1).clamp(min=0).float()[:, None], out=t)
            t += (torch.arange(channels) * cols).float()[:, None]
        if finite is not None:
            idx = t[finite.reshape(t.shape)].to(torch.int32)
        else:
            idx = self._scratch("_buf_i", (t.numel(),), torch.int32)
            idx.copy_(t.view(-1))  # float -> int truncates: floor for t >= 0
        binned = torch.bincount(idx, minlength=channels * cols)
        self.counts.view(-1).add_(binned.to(torch.float64))

    def _scratch(self, name: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        buf = getattr(self, name, None)
        numel = math.prod(shape)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=dtype)
            setattr(self, name, buf)
        return buf[:numel].view(shape)

    def _count_wide(self, values: torch.Tensor, finite: torch.Tensor | None) -> None:
        channels, cols = self.counts.shape
        w32 = torch.where(self.width > 0, self.width, 1.0).float()
        v = values if self.signed else values.abs()
        idx = torch.floor(v / w32[:, None]).to(torch.int64) - self.first[:, None]
        idx = torch.minimum(idx.clamp_(min=0), (self.nbins - 1).clamp(min=0)[:, None])
        idx += (torch.arange(channels) * cols)[:, None]
        if finite is not None:
            idx = idx[finite]
        self.counts.view(-1).add_(torch.bincount(idx.reshape(-1), minlength=channels * cols).to(torch.float64))

    # ---- merging --------------------------------------------------------------------
    def __getstate__(self) -> dict[str, object]:
        """Pickle without the scratch buffers (observers travel between processes to be merged)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("_buf_f", "_buf_i")}

    def copy(self) -> Histogram:
        out = Histogram(self.num_bins, signed=self.signed, grid=self.grid, max_bins=self.max_bins)
        out.channels = self.channels
        for name in ("width", "first", "nbins", "counts", "pending_zeros", "vmin", "vmax"):
            setattr(out, name, getattr(self, name).clone())
        return out

    def merge(self, other: Histogram) -> None:
        """Add `other`'s counts (same options and channel count) into this histogram."""
        if other.channels == 0:
            return
        if self.channels == 0:
            self._allocate(other.channels)
        theirs = other.copy()
        self.vmin = theirs.vmin = torch.minimum(self.vmin, other.vmin)
        self.vmax = theirs.vmax = torch.maximum(self.vmax, other.vmax)
        has = torch.isfinite(self.vmax)
        compatible = (self.width == other.width) | ~self.initialized | ~other.initialized
        if self.grid is GridMode.POW2 or bool(compatible.all()):
            if self.grid is GridMode.POW2:
                width = torch.maximum(self._target_width(has), theirs._target_width(has))
            else:
                width = torch.where(self.initialized, self.width, other.width)
                width = torch.where(has & (width == 0), self._target_width(has), width)
                width = self._bounded_cover(width)[0]
            first_a, last_a = self._cover(width)
            first_b, last_b = theirs._cover(width)
            first, last = torch.minimum(first_a, first_b), torch.maximum(last_a, last_b)
            self._regrid(width, first, last)
            theirs._regrid(width, first, last)
            cols = self.counts.shape[1]
            self.counts += torch.nn.functional.pad(theirs.counts, (0, cols - theirs.counts.shape[1]))
            self.pending_zeros += theirs.pending_zeros
            self._flush_pending()
            return
        # TensorRT grids of different widths: spread the other's counts over this grid
        width = torch.where(self.initialized, self.width, other.width)
        self._regrid(*self._bounded_cover(width))
        self.pending_zeros += torch.where(other.initialized, 0.0, other.pending_zeros)
        for c in range(self.channels):
            if not bool(other.initialized[c]):
                continue
            src_counts, src_edges = other.channel(c)
            n = int(self.nbins[c])
            k = self.first[c] + torch.arange(n + 1, dtype=torch.int64)
            dst_edges = k.to(torch.float64) * self.width[c]
            cum = torch.cat([torch.zeros(1, dtype=torch.float64), src_counts.cumsum(0)])
            at = _interp(dst_edges, src_edges, cum)
            at[-1] = cum[-1]  # the last bin holds the range's top value
            self.counts[c, :n] += at.diff()
        self._flush_pending()


def _interp(x: torch.Tensor, xp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    """Piecewise-linear interpolation of (xp, fp) at x, constant outside (numpy.interp)."""
    idx = torch.searchsorted(xp, x, right=True).clamp(1, xp.numel() - 1)
    x0, x1 = xp[idx - 1], xp[idx]
    y0, y1 = fp[idx - 1], fp[idx]
    t = torch.where(x1 > x0, (x - x0) / torch.where(x1 > x0, x1 - x0, 1.0), 1.0).clamp(0, 1)
    return y0 + t * (y1 - y0)
