"""Temporary min-max observer used until netquant.calib's registry is available."""

from __future__ import annotations

from typing import Any

import torch

from netquant.core.qparams import QParams, choose_qparams
from netquant.core.spec import Granularity, QuantSpec
from netquant.errors import ConfigError


class _MinMax:
    def __init__(self, spec: QuantSpec) -> None:
        self.spec = spec
        self.lo: torch.Tensor | None = None
        self.hi: torch.Tensor | None = None

    def _reduce(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self.spec
        if spec.granularity is Granularity.PER_TENSOR:
            return x.min(), x.max()
        axis = spec.axis % x.dim()
        moved = x.movedim(axis, 0)
        if spec.granularity is Granularity.PER_CHANNEL:
            flat = moved.reshape(moved.shape[0], -1)
            return flat.min(dim=1).values, flat.max(dim=1).values
        g = spec.group_size
        n = moved.shape[0]
        groups = -(-n // g)
        pad = groups * g - n
        lo_src = torch.cat([moved, moved[-1:].expand(pad, *moved.shape[1:])]) if pad else moved
        blocks = lo_src.reshape(groups, g, *moved.shape[1:])
        return blocks.amin(dim=1).movedim(0, axis), blocks.amax(dim=1).movedim(0, axis)

    def observe(self, x: torch.Tensor) -> None:
        lo, hi = self._reduce(x.detach().float())
        self.lo = lo if self.lo is None else torch.minimum(self.lo, lo)
        self.hi = hi if self.hi is None else torch.maximum(self.hi, hi)

    def compute_params(self) -> QParams:
        assert self.lo is not None and self.hi is not None
        return choose_qparams(self.lo, self.hi, self.spec)


def make_observer(name: str, spec: QuantSpec, **opts: Any) -> _MinMax:
    if name not in {"minmax", "ema", "percentile", "kl", "mse", "hist_l2", "fixed", "none"}:
        raise ConfigError(f"unknown observer {name!r}")
    return _MinMax(spec)
