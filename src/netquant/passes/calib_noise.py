"""How far onnxruntime's FP32 values of one tensor may lie from the executor's, by magnitude (passes.calib_ort).

Both engines compute the same float32 values up to summation order, so an element's difference grows with the terms
it sums, not with the tensor's largest value: a tensor spanning [-1.3, 74] may differ by 1e-4 near 74 and by 1e-7
near -1.3. On the first calibration batch the executor's observed tensors are kept (strided, `Kept`) and compared
with onnxruntime's element by element:

    noise(m) = max |ort - executor| over the elements with |executor| < 2^k, the smallest power of two 2^k > m
               (a running maximum over power-of-two magnitude buckets)

so a range end v is given the margin of elements up to twice its magnitude, which includes every small element whose
value cancelled out of large terms. Beyond the largest magnitude measured, noise grows in proportion.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

import torch

KEEP_ELEMENTS = 1 << 20  # the executor's tensors are kept as at most this many elements, evenly strided
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)


@dataclass(frozen=True)
class Kept:
    """Every `step`-th element of a flattened tensor of `numel` elements (the executor's, for NoiseProfile)."""

    numel: int
    step: int
    values: torch.Tensor

    @classmethod
    def of(cls, x: torch.Tensor) -> Kept:
        step = max(1, -(-x.numel() // KEEP_ELEMENTS))
        return cls(x.numel(), step, x.detach().float().reshape(-1)[::step].clone())


@dataclass(frozen=True)
class NoiseProfile:
    """noise(m) of one tensor (module docstring): bounds (increasing powers of two) and the running maximum of
    |ort - executor| over elements of magnitude <= each bound; top: the largest magnitude measured."""

    bounds: tuple[float, ...]
    worst: tuple[float, ...]
    top: float

    @classmethod
    def measure(cls, ort: torch.Tensor, executor: Kept) -> NoiseProfile | None:
        """The profile of onnxruntime's tensor against the executor's kept elements; None when the sizes differ."""
        if ort.numel() != executor.numel:
            return None
        a = ort.detach().float().reshape(-1)[::executor.step]
        b = executor.values
        if not b.numel():
            return cls((), (), 0.0)
        mag, diff = b.abs(), (a - b).abs()
        exps = torch.frexp(mag).exponent.long()  # mag < 2^exp (0 -> exponent 0)
        low = int(exps.min())
        per = torch.full((int(exps.max()) - low + 1,), -1.0, dtype=diff.dtype)
        per.scatter_reduce_(0, exps - low, diff, "amax", include_self=True)  # -1: a bucket without elements
        present = (per >= 0).nonzero().reshape(-1)
        bounds = [math.ldexp(1.0, int(k) + low) for k in present]
        worst = torch.cummax(per[present], 0).values.tolist()
        return cls(tuple(bounds), tuple(float(w) for w in worst), float(mag.max()))

    def with_point(self, magnitude: float, diff: float) -> NoiseProfile:
        """The profile with one more (magnitude, difference) pair (an extremum compared on another first batch)."""
        exp = math.frexp(magnitude)[1] if magnitude > 0 else 0
        bound = math.ldexp(1.0, exp)
        pairs = dict(zip(self.bounds, self.worst))
        pairs[bound] = max(pairs.get(bound, 0.0), diff)
        bounds = sorted(pairs)
        worst, run = [], 0.0
        for k in bounds:
            run = max(run, pairs[k])
            worst.append(run)
        return NoiseProfile(tuple(bounds), tuple(worst), max(self.top, magnitude))

    def at(self, m: float) -> float:
        """Largest difference among elements of magnitude <= m; beyond the largest measured magnitude, the overall
        largest difference scaled by m / top."""
        if not self.bounds:
            return 0.0
        if m >= self.top or m >= self.bounds[-1]:
            return self.worst[-1] * max(1.0, m / max(self.top, FLOAT32_TINY))
        i = bisect.bisect_left(self.bounds, m)
        return self.worst[i]
