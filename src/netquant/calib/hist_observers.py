"""Histogram observers: entropy (KL), percentile, MSE (TensorRT family) and torch.ao's L2 search.

The TensorRT family histograms |x| and picks a threshold t per channel; the range is then
(lo, hi) = (max(min x, -t), min(max x, t)) widened to include 0: t for symmetric specs, and
both ends clipped for affine ones.  `HistL2Observer` histograms x itself and picks both ends.
"""

from __future__ import annotations

import torch

from netquant.calib.base import Batch, Observer, extend_range
from netquant.calib.histogram import GridMode, Histogram
from netquant.calib.registry import register_observer
from netquant.calib.search import entropy_threshold_bin, l2_range_bins, percentile_bin
from netquant.core.ops import fake_quantize
from netquant.core.qparams import choose_qparams
from netquant.core.spec import Granularity, QuantSpec
from netquant.errors import ConfigError

_MSE_CHUNK = 1 << 18  # candidate x bin elements evaluated at once (cache-sized blocks are fastest)


def _clip_range(min_val: torch.Tensor, max_val: torch.Tensor, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max(min x, -t), min(max x, t)), widened to include 0 as choose_qparams would."""
    lo = torch.minimum(torch.maximum(min_val, -t), torch.zeros_like(t))
    hi = torch.maximum(torch.minimum(max_val, t), torch.zeros_like(t))
    return lo, hi


class HistogramObserverBase(Observer):
    """Keeps a per-channel histogram (bounded memory) plus the exact min and max seen."""

    signed_histogram = False

    def __init__(self, spec: QuantSpec | None = None, *, num_bins: int = 2048,
                 grid: GridMode | str = GridMode.TENSORRT, max_bins: int | None = None, **kw: object) -> None:
        super().__init__(spec, **kw)  # type: ignore[arg-type]
        try:
            grid = GridMode(grid)
        except ValueError:
            raise ConfigError(f"{self._error_prefix()}: grid must be one of "
                              f"{[g.value for g in GridMode]}, got {grid!r}") from None
        if not isinstance(num_bins, int) or num_bins < 2:
            raise ConfigError(f"{self._error_prefix()}: num_bins must be an int >= 2, got {num_bins!r}")
        self.hist = Histogram(num_bins, signed=self.signed_histogram, grid=grid, max_bins=max_bins)
        self.min_val: torch.Tensor | None = None
        self.max_val: torch.Tensor | None = None

    def _options(self) -> dict[str, object]:
        return {"num_bins": self.hist.num_bins, "grid": self.hist.grid, "max_bins": self.hist.max_bins}

    @property
    def order_invariant(self) -> bool:  # type: ignore[override]
        """POW2 grids depend only on the values seen (calib.histogram); TensorRT grids take their width from the
        first batch, so stacking samples would change them."""
        return self.hist.grid is GridMode.POW2

    def _update(self, batch: Batch) -> None:
        self.hist.add(batch.values, batch.finite, batch.cmin, batch.cmax)
        self.min_val, self.max_val = extend_range(self.min_val, self.max_val, batch.cmin, batch.cmax)

    def _merge_state(self, other: Observer) -> None:
        assert isinstance(other, HistogramObserverBase)
        assert other.min_val is not None and other.max_val is not None
        self.hist.merge(other.hist)
        self.min_val, self.max_val = extend_range(self.min_val, self.max_val, other.min_val, other.max_val)

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.min_val is not None and self.max_val is not None
        thresholds = torch.full((self.hist.channels,), float("nan"))
        for c in range(self.hist.channels):
            if not torch.isfinite(self.max_val[c]):
                continue
            counts, edges = self.hist.channel(c)
            thresholds[c] = self._threshold(c, counts, edges)
        return _clip_range(self.min_val, self.max_val, thresholds)

    def _threshold(self, channel: int, counts: torch.Tensor, edges: torch.Tensor) -> float:
        raise NotImplementedError


@register_observer("kl", aliases=("entropy",))
class KLObserver(HistogramObserverBase):
    """TensorRT entropy calibration: the |x| threshold minimizing KL(P || Q) (see search.py).

    Q has `num_quant_bins` levels: 2^(bits-1) for signed specs, 2^bits for unsigned (TensorRT's
    1 << (num_bits - 1 + unsigned)).  Candidates start at `start_bin`; ties go to the larger one.
    """

    def __init__(self, spec: QuantSpec | None = None, *, start_bin: int = 128, stride: int = 1,
                 num_quant_bins: int | None = None, **kw: object) -> None:
        super().__init__(spec, **kw)  # type: ignore[arg-type]
        if start_bin < 1 or stride < 1:
            raise ConfigError(f"{self._error_prefix()}: start_bin and stride must be >= 1, "
                              f"got {start_bin}, {stride}")
        self.start_bin, self.stride = start_bin, stride
        default = 2 ** (self.spec.bits - 1) if self.spec.signed else 2 ** self.spec.bits
        self.num_quant_bins = num_quant_bins if num_quant_bins is not None else default
        if self.num_quant_bins < 1:
            raise ConfigError(f"{self._error_prefix()}: num_quant_bins must be >= 1")

    def _options(self) -> dict[str, object]:
        return {**super()._options(), "start_bin": self.start_bin, "stride": self.stride,
                "num_quant_bins": self.num_quant_bins}

    def _threshold(self, channel: int, counts: torch.Tensor, edges: torch.Tensor) -> float:
        i = entropy_threshold_bin(counts, self.num_quant_bins, self.start_bin, self.stride)
        return float(edges[i])


@register_observer("percentile")
class PercentileObserver(HistogramObserverBase):
    """The |x| threshold below which `percentile` % of the values lie, to within one bin.

    TensorRT convention: the lower edge of the bin holding the value of rank p/100 * count,
    found from exact cumulative counts; `tensorrt_cdf=True` uses pytorch-quantization's rounded
    cumulative shares instead (bit-exact with it, but can be off by many bins; see search.py).
    """

    def __init__(self, spec: QuantSpec | None = None, *, percentile: float = 99.99, tensorrt_cdf: bool = False,
                 **kw: object) -> None:
        super().__init__(spec, **kw)  # type: ignore[arg-type]
        if not 0.0 <= float(percentile) <= 100.0:
            raise ConfigError(f"{self._error_prefix()}: percentile must be in [0, 100], got {percentile}")
        self.percentile = float(percentile)
        self.tensorrt_cdf = bool(tensorrt_cdf)

    def _options(self) -> dict[str, object]:
        return {**super()._options(), "percentile": self.percentile, "tensorrt_cdf": self.tensorrt_cdf}

    def _threshold(self, channel: int, counts: torch.Tensor, edges: torch.Tensor) -> float:
        return float(edges[percentile_bin(counts, self.percentile, tensorrt_cdf=self.tensorrt_cdf)])


@register_observer("mse")
class MSEObserver(HistogramObserverBase):
    """The |x| threshold t minimizing sum_bins count * (fake_quantize(center) - center)^2.

    Candidates are the bin centers from `start_bin` on (TensorRT); each candidate's params come
    from the clipped range (max(min x, -t), min(max x, t)) and the error from netquant's own
    fake_quantize, so rounding, clipping, narrow range and power-of-two scales are those of
    deployment.  The error is measured on the |x| histogram placed on the side of the larger
    magnitude (exact for symmetric specs and for one-signed data, e.g. after ReLU).
    Ties go to the smaller threshold.
    """

    def __init__(self, spec: QuantSpec | None = None, *, start_bin: int = 128, stride: int = 1,
                 **kw: object) -> None:
        super().__init__(spec, **kw)  # type: ignore[arg-type]
        if start_bin < 0 or stride < 1:
            raise ConfigError(f"{self._error_prefix()}: need start_bin >= 0 and stride >= 1")
        self.start_bin, self.stride = start_bin, stride
        self._candidate_spec = self.spec.with_(granularity=Granularity.PER_CHANNEL, axis=0, group_size=None)

    def _options(self) -> dict[str, object]:
        return {**super()._options(), "start_bin": self.start_bin, "stride": self.stride}

    def _threshold(self, channel: int, counts: torch.Tensor, edges: torch.Tensor) -> float:
        assert self.min_val is not None
        centers = ((edges[1:] + edges[:-1]) / 2).float()
        n = centers.numel()
        cand = torch.arange(self.start_bin, n, self.stride) if self.start_bin < n else torch.tensor([n - 1])
        amax = centers[cand]
        if float(amax.max()) <= 0:
            return 0.0
        lo, hi = _clip_range(self.min_val[channel].expand_as(amax), self.max_val[channel].expand_as(amax), amax)
        # |x| stands for the side of the data holding the largest magnitude
        side = -1.0 if float(-self.min_val[channel]) > float(self.max_val[channel]) else 1.0
        points = centers * side
        weights = counts.to(torch.float64)
        errors = []
        step = max(1, _MSE_CHUNK // max(n, 1))
        for s in range(0, amax.numel(), step):
            qp = choose_qparams(lo[s:s + step], hi[s:s + step], self._candidate_spec, name=self.tensor_name)
            grid = points.expand(qp.scale.numel(), n)
            fq = fake_quantize(grid, qp.scale, qp.zero_point, self._candidate_spec)
            errors.append((((fq.double() - grid.double()) ** 2) * weights).sum(dim=1))
        err = torch.cat(errors)
        return float(amax[int(torch.argmin(err))])


@register_observer("hist_l2")
class HistL2Observer(HistogramObserverBase):
    """torch.ao HistogramObserver's range search: both ends of a histogram of x, chosen by
    greedy L2-error minimization over 2^bits destination bins (see search.l2_range_bins)."""

    signed_histogram = True

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.min_val is not None and self.max_val is not None
        lo = torch.full((self.hist.channels,), float("nan"))
        hi = torch.full((self.hist.channels,), float("nan"))
        dst = 2 ** self.spec.bits
        for c in range(self.hist.channels):
            if not torch.isfinite(self.max_val[c]):
                continue
            counts, edges = self.hist.channel(c)
            start, end = l2_range_bins(counts, dst)
            lo[c] = float(edges[start])
            hi[c] = float(edges[end + 1])
        lo = torch.maximum(lo, self.min_val)
        hi = torch.minimum(hi, self.max_val)
        return lo, hi
