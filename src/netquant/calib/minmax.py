"""Min-max observers: the running extremes, plain or as an exponential moving average."""

from __future__ import annotations

import torch

from netquant.calib.base import Batch, Observer, extend_range
from netquant.calib.registry import register_observer
from netquant.core.spec import QuantSpec
from netquant.errors import ConfigError


@register_observer("minmax", aliases=("max",))
class MinMaxObserver(Observer):
    """lo = min over all batches of min(x), hi = max over all batches of max(x) (per channel)."""

    reads_values = False
    order_invariant = True  # min and max of a union are the min and max of the parts'

    def __init__(self, spec: QuantSpec | None = None, **kw: object) -> None:
        super().__init__(spec, **kw)  # type: ignore[arg-type]
        self.min_val: torch.Tensor | None = None
        self.max_val: torch.Tensor | None = None

    def _update(self, batch: Batch) -> None:
        self.min_val, self.max_val = extend_range(self.min_val, self.max_val, batch.cmin, batch.cmax)

    def _merge_state(self, other: Observer) -> None:
        assert isinstance(other, MinMaxObserver) and other.min_val is not None and other.max_val is not None
        self.min_val, self.max_val = extend_range(self.min_val, self.max_val, other.min_val, other.max_val)

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.min_val is not None and self.max_val is not None
        return self.min_val, self.max_val


@register_observer("ema", aliases=("moving_average",))
class EmaMinMaxObserver(Observer):
    """Moving-average extremes (torch.ao MovingAverageMinMaxObserver):

    m_1 = min(x_1);  m_k = m_{k-1} + c * (min(x_k) - m_{k-1})   (c = momentum, likewise for max).

    For merging it also keeps, per channel, D = (1-c)^n and S = sum_k c (1-c)^(n-k) min(x_k),
    so that continuing from another observer's value m_a gives m = D * m_a + S exactly.
    """

    def __init__(self, spec: QuantSpec | None = None, *, momentum: float = 0.01, **kw: object) -> None:
        super().__init__(spec, **kw)  # type: ignore[arg-type]
        if not 0.0 < momentum <= 1.0:
            raise ConfigError(f"{self._error_prefix()}: momentum must be in (0, 1], got {momentum}")
        self.momentum = float(momentum)
        self.min_val: torch.Tensor | None = None  # float32, exactly torch.ao's arithmetic
        self.max_val: torch.Tensor | None = None
        self._decay: torch.Tensor | None = None  # (C,) float64: (1-c)^n_c
        self._acc_min: torch.Tensor | None = None  # (C,) float64: S for min
        self._acc_max: torch.Tensor | None = None

    def _options(self) -> dict[str, object]:
        return {"momentum": self.momentum}

    def _update(self, batch: Batch) -> None:
        c = self.momentum
        seen = torch.isfinite(batch.cmin)  # channels with data in this batch
        if self.min_val is None:
            channels = batch.num_channels
            self.min_val = torch.full((channels,), float("inf"))
            self.max_val = torch.full((channels,), float("-inf"))
            self._decay = torch.ones(channels, dtype=torch.float64)
            self._acc_min = torch.zeros(channels, dtype=torch.float64)
            self._acc_max = torch.zeros(channels, dtype=torch.float64)
        assert self.max_val is not None and self._decay is not None
        assert self._acc_min is not None and self._acc_max is not None
        fresh = torch.isinf(self.min_val)
        new_min = torch.where(fresh, batch.cmin, self.min_val + c * (batch.cmin - self.min_val))
        new_max = torch.where(fresh, batch.cmax, self.max_val + c * (batch.cmax - self.max_val))
        self.min_val = torch.where(seen, new_min, self.min_val)
        self.max_val = torch.where(seen, new_max, self.max_val)
        keep = 1.0 - c
        self._decay = torch.where(seen, self._decay * keep, self._decay)
        self._acc_min = torch.where(seen, self._acc_min * keep + c * batch.cmin.double(), self._acc_min)
        self._acc_max = torch.where(seen, self._acc_max * keep + c * batch.cmax.double(), self._acc_max)

    def _merge_state(self, other: Observer) -> None:
        assert isinstance(other, EmaMinMaxObserver) and other.min_val is not None
        assert other.max_val is not None and other._decay is not None
        assert other._acc_min is not None and other._acc_max is not None
        if self.min_val is None:
            self.min_val, self.max_val = other.min_val.clone(), other.max_val.clone()
            self._decay, self._acc_min, self._acc_max = (other._decay.clone(), other._acc_min.clone(),
                                                         other._acc_max.clone())
            return
        assert self.max_val is not None and self._decay is not None
        assert self._acc_min is not None and self._acc_max is not None
        mine = torch.isfinite(self.min_val)
        theirs = torch.isfinite(other.min_val)
        cont_min = (other._decay * self.min_val.double() + other._acc_min).float()
        cont_max = (other._decay * self.max_val.double() + other._acc_max).float()
        self.min_val = torch.where(theirs, torch.where(mine, cont_min, other.min_val), self.min_val)
        self.max_val = torch.where(theirs, torch.where(mine, cont_max, other.max_val), self.max_val)
        self._acc_min = torch.where(theirs, other._decay * self._acc_min + other._acc_min, self._acc_min)
        self._acc_max = torch.where(theirs, other._decay * self._acc_max + other._acc_max, self._acc_max)
        self._decay = self._decay * other._decay

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.min_val is not None and self.max_val is not None
        return self.min_val, self.max_val
