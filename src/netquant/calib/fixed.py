"""Observers that need no data: a known fixed range, and none at all for passive tensors."""

from __future__ import annotations

import torch

from netquant.calib.base import Batch, Observer
from netquant.calib.registry import register_observer
from netquant.core.qparams import QParams
from netquant.core.spec import QuantSpec
from netquant.errors import ConfigError


@register_observer("fixed")
class FixedRangeObserver(Observer):
    """A range known in advance, e.g. Sigmoid's [0, 1] or Tanh's [-1, 1]; batches are ignored.

    `min_val` / `max_val` are floats, or (C,) sequences / tensors for per-channel specs.
    """

    order_invariant = True  # the data is ignored

    def __init__(self, spec: QuantSpec | None = None, *, min_val: float | torch.Tensor | list[float] = 0.0,
                 max_val: float | torch.Tensor | list[float] = 1.0, **kw: object) -> None:
        super().__init__(spec, **kw)  # type: ignore[arg-type]
        lo = torch.as_tensor(min_val, dtype=torch.float32)
        hi = torch.as_tensor(max_val, dtype=torch.float32)
        if lo.shape != hi.shape:
            raise ConfigError(f"{self._error_prefix()}: min_val shape {tuple(lo.shape)} != max_val shape "
                              f"{tuple(hi.shape)}")
        if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()) or bool((lo > hi).any()):
            raise ConfigError(f"{self._error_prefix()}: need finite min_val <= max_val, got "
                              f"{lo.tolist()} and {hi.tolist()}")
        self.min_val, self.max_val = lo, hi
        self._param_shape = tuple(lo.shape)

    def _options(self) -> dict[str, object]:
        return {"min_val": self.min_val.tolist(), "max_val": self.max_val.tolist()}

    def observe(self, x: torch.Tensor) -> None:
        self.num_batches += 1

    def _require_data(self) -> None:
        return None

    def _update(self, batch: Batch) -> None:  # pragma: no cover - observe() never builds batches
        return None

    def _merge_state(self, other: Observer) -> None:
        return None

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.min_val.reshape(-1), self.max_val.reshape(-1)


@register_observer("none")
class NoObserver(Observer):
    """For passive tensors whose params come from elsewhere (shared with a producer, derived)."""

    order_invariant = True

    def observe(self, x: torch.Tensor) -> None:
        self.num_batches += 1

    def _update(self, batch: Batch) -> None:  # pragma: no cover - observe() never builds batches
        return None

    def _merge_state(self, other: Observer) -> None:
        return None

    def _range(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._passive_error()

    def range(self) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._passive_error()

    def compute_params(self) -> QParams:
        raise self._passive_error()

    def _passive_error(self) -> ConfigError:
        return ConfigError(f"tensor '{self.tensor_name}' has no observer (passive): its params are "
                           f"derived from or shared with another tensor's; ask that tensor's observer")


