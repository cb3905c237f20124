"""Batched calibration: calibration batches of equal shape stacked along dim 0 into one executor run.

Stacking changes nothing the observers end up with when
(a) every activation observer's state depends only on the values seen, not on how they were batched
    (`Observer.order_invariant`: min-max, power-of-two-grid histograms, fixed ranges) and is per-tensor, and
(b) the executor computes each sample of a stack as it computes it alone: no op mixes the batch dim (a Reduce
    over axis 0, a Reshape folding the batch into features, a recurrence along dim 0). (b) is checked, not
    assumed: the first calibration batches (run one by one for export validation anyway) are run once more as one
    stack, and stacking is used only if the stacked run gives the graph outputs (concatenated) and the extrema of
    every observed tensor up to float summation noise (CHECK_RTOL). Otherwise every batch runs as given, as before.

Bit-identical means the scales and zero points: a stacked MatMul or Conv may pick another kernel than a single
sample's (on AMD EPYC with torch 2.13: the encoder's MatMuls bit-equal at 3 samples, last-bit differences at 8), the same
summation-order noise as another thread count, which the range rounding of calib.ranges (range_bits, default 8)
absorbs; with range_bits=None (exact ranges) nothing is stacked.

Only batches of fewer than STACK_WORTH_BELOW samples are stacked (per-sample lists, the usual case): batches of 8
or more are batched already, and the check's extra run of the first batches would cost more than stacking saves.
Stack size: as many samples as fit `budget_mb` of observed activations (bytes per sample measured in the first
runs), at most STACK_MAX_SAMPLES.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from netquant.core.spec import Granularity

STACK_MAX_SAMPLES = 64
STACK_WORTH_BELOW = 8  # batches given with at least this many samples run as given (already batched)
CHECK_RTOL = 1e-4  # the stacking check's tolerance: float summation noise passes, an op mixing the batch does not

Batch = dict[str, torch.Tensor]


def samples_in(batch: Mapping[str, Any]) -> int:
    """Samples in a batch: the leading dim of its first tensor (1 when it has none)."""
    first = next(iter(batch.values()), None)
    return int(first.shape[0]) if isinstance(first, torch.Tensor) and first.dim() > 0 else 1


def split_at(batch: Mapping[str, Any], n: int) -> tuple[Batch, Batch] | None:
    """(the first n samples, the rest) of a batch whose tensors all hold more than n samples along dim 0; None
    otherwise."""
    if not batch or not all(isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == samples_in(batch)
                            for v in batch.values()) or not 0 < n < samples_in(batch):
        return None
    return {k: v[:n] for k, v in batch.items()}, {k: v[n:] for k, v in batch.items()}


def same_layout(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Batches that concatenate along dim 0: same inputs, dtypes and shapes past dim 0."""
    if a.keys() != b.keys():
        return False
    return all(a[k].dim() > 0 and a[k].dim() == b[k].dim() and a[k].dtype == b[k].dtype
               and a[k].shape[1:] == b[k].shape[1:] for k in a)


def concat(batches: Sequence[Mapping[str, torch.Tensor]]) -> Batch:
    """The batches stacked along dim 0 (one batch: itself)."""
    if len(batches) == 1:
        return dict(batches[0])
    return {k: torch.cat([b[k] for b in batches], dim=0) for k in batches[0]}


def stack_blocker(input_shapes: Iterable[tuple[str, Sequence[Any] | None]], observers: Iterable[Any]) -> str | None:
    """Why this graph's calibration cannot be stacked (None: it may be, subject to the first-batches check)."""
    for name, shape in input_shapes:
        if not shape:
            return f"input '{name}' has no known batch dim"
        if isinstance(shape[0], int) and shape[0] > 0:
            return f"input '{name}' has a static batch dim {shape[0]}"
    for obs in observers:
        if not obs.order_invariant:
            return f"observer '{obs.name}' of '{obs.tensor_name}' depends on how samples are batched"
        if obs.spec.granularity is not Granularity.PER_TENSOR:
            return f"observer of '{obs.tensor_name}' is per-channel on an activation"
    return None


def stack_size(bytes_per_sample: float, budget_mb: float) -> int:
    """Samples per stack: floor(budget / bytes per sample), in [1, STACK_MAX_SAMPLES]."""
    if bytes_per_sample <= 0:
        return STACK_MAX_SAMPLES
    return int(max(1, min(STACK_MAX_SAMPLES, budget_mb * 2 ** 20 // bytes_per_sample)))


@dataclass
class Extrema:
    """Per observed tensor (by hook key): the running (min, max) of its values, plus bytes seen."""

    ranges: dict[tuple[str, str, int], tuple[float, float]] = field(default_factory=dict)
    nbytes: int = 0

    def add(self, key: tuple[str, str, int], x: torch.Tensor) -> None:
        self.nbytes += x.numel() * x.element_size()
        if x.numel() == 0:
            return
        lo, hi = torch.aminmax(x.detach().reshape(-1).float())
        old = self.ranges.get(key)
        lo_f, hi_f = float(lo), float(hi)
        self.ranges[key] = (lo_f, hi_f) if old is None else (min(old[0], lo_f), max(old[1], hi_f))

    def same(self, other: Extrema) -> bool:
        """Equal ranges for every key up to float summation noise (CHECK_RTOL of the larger magnitude)."""
        if self.ranges.keys() != other.ranges.keys():
            return False
        a = torch.tensor([self.ranges[k] for k in self.ranges], dtype=torch.float64)
        b = torch.tensor([other.ranges[k] for k in self.ranges], dtype=torch.float64)
        return _close(a, b)


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """|a - b| <= CHECK_RTOL * max|a| elementwise (NaN where the other is NaN; infinities equal)."""
    if a.shape != b.shape:
        return False
    if not torch.equal(a.isnan(), b.isnan()):
        return False
    a, b = a.double().nan_to_num(0.0, 0.0, 0.0), b.double().nan_to_num(0.0, 0.0, 0.0)
    scale = float(a.abs().max()) if a.numel() else 0.0
    return bool(((a - b).abs() <= CHECK_RTOL * max(scale, 1e-30)).all())


def same_outputs(parts: Sequence[Mapping[str, Any]], whole: Mapping[str, Any]) -> bool:
    """The stacked run's outputs equal the parts' outputs concatenated along dim 0, up to summation noise."""
    for name, w in whole.items():
        got = [p.get(name) for p in parts]
        if not isinstance(w, torch.Tensor) or w.dim() == 0:
            return False
        if any(not isinstance(g, torch.Tensor) or g.dim() == 0 for g in got):
            return False
        try:
            ref = torch.cat(got, dim=0)  # type: ignore[arg-type]
        except RuntimeError:
            return False
        if not _close(ref, w):
            return False
    return True
