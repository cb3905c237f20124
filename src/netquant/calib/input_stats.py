"""Statistics of a weight op's input activation for weight-only algorithms (GPTQ, AWQ, clip search).

For rows x_t in R^K of the activation (all leading dims flattened), accumulated over batches:
    hessian   H = 2 / T * sum_t x_t x_t^T          (GPTQ; only when asked: K x K float64)
    abs_mean  a_k = 1 / T * sum_t |x_tk|            (AWQ's channel salience)
    sq_mean   m_k = 1 / T * sum_t x_tk^2            (importance of input channel k in clip search)
    samples   up to `max_rows` rows, a fixed stride of each batch (AWQ's error evaluation)
Two accumulators over disjoint data merge exactly (sums and counts add; samples concatenate in order).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from netquant.errors import DataError


@dataclass
class InputStatistics:
    k: int
    with_hessian: bool = False
    rows_per_batch: int = 64
    max_rows: int = 2048
    count: int = 0
    abs_sum: torch.Tensor = field(init=False)
    sq_sum: torch.Tensor = field(init=False)
    xtx: torch.Tensor | None = field(init=False, default=None)
    samples: list[torch.Tensor] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.abs_sum = torch.zeros(self.k, dtype=torch.float64)
        self.sq_sum = torch.zeros(self.k, dtype=torch.float64)
        if self.with_hessian:
            self.xtx = torch.zeros(self.k, self.k, dtype=torch.float64)

    def observe(self, x: torch.Tensor, name: str = "activation") -> None:
        rows = x.detach().reshape(-1, x.shape[-1]).to(torch.float64)
        if rows.shape[1] != self.k:
            raise DataError(f"weight-only calibration: activation '{name}' has {rows.shape[1]} channels, its weight "
                            f"expects {self.k}")
        if not torch.isfinite(rows).all():
            raise DataError(f"weight-only calibration: activation '{name}' holds NaN or Inf; check the calibration "
                            "data and the model")
        self.count += rows.shape[0]
        self.abs_sum += rows.abs().sum(0)
        self.sq_sum += (rows * rows).sum(0)
        if self.xtx is not None:
            self.xtx += rows.t() @ rows
        kept = sum(s.shape[0] for s in self.samples)
        if kept < self.max_rows:
            stride = max(1, rows.shape[0] // self.rows_per_batch)
            self.samples.append(rows[::stride][: self.max_rows - kept].to(torch.float32))

    def merge(self, other: InputStatistics) -> None:
        self.count += other.count
        self.abs_sum += other.abs_sum
        self.sq_sum += other.sq_sum
        if self.xtx is not None and other.xtx is not None:
            self.xtx += other.xtx
        self.samples.extend(other.samples)
        total = 0
        for i, s in enumerate(self.samples):
            if total + s.shape[0] > self.max_rows:
                self.samples[i] = s[: self.max_rows - total]
                del self.samples[i + 1:]
                break
            total += s.shape[0]

    def _need(self, name: str) -> None:
        if self.count == 0:
            raise DataError(f"weight-only calibration: activation '{name}' was never computed; give calibration data "
                            "that reaches it")

    def hessian(self, name: str = "activation") -> torch.Tensor:
        self._need(name)
        if self.xtx is None:
            raise DataError(f"weight-only calibration of '{name}' kept no Hessian; build it with with_hessian=True")
        return (2.0 / self.count) * self.xtx

    def abs_mean(self) -> torch.Tensor:
        return (self.abs_sum / max(self.count, 1)).to(torch.float32)

    def sq_mean(self) -> torch.Tensor:
        return (self.sq_sum / max(self.count, 1)).to(torch.float32)

    def sample_rows(self) -> torch.Tensor:
        return torch.cat(self.samples) if self.samples else torch.zeros(0, self.k)
