"""Observers merged across torch.distributed ranks, exactly where their state allows it.

`merge_across_ranks` gathers every rank's observers (all_gather_object) and merges them in rank order on every
rank (`Observer.merge`), so all ranks end with the same state. For order-invariant observers
(`Observer.order_invariant`: min-max, power-of-two-grid histograms, fixed ranges) that state is the one a single
process would reach on all the ranks' data, whatever the split; `check_mergeable` refuses the others (EMA,
TensorRT-grid histograms) with the fix named.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from netquant.errors import ConfigError


def check_mergeable(observers: Sequence[Any]) -> None:
    """ConfigError naming the first observer whose merged state would depend on how the data was split."""
    for obs in observers:
        if obs is not None and not obs.order_invariant:
            raise ConfigError(
                f"distributed calibration: the {obs.name} observer of '{obs.tensor_name}' depends on how samples are "
                "split into batches, so merging ranks would not give one process's scales; use "
                f"observer_options={{'{obs.name}': {{'grid': 'pow2'}}}} (histogram observers) or the minmax observer")


def merge_across_ranks(observers: Sequence[Any]) -> list[Any]:
    """Every rank's observers (None: saw nothing there) merged in rank order; the same list on every rank."""
    import torch.distributed as dist

    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, list(observers))
    merged: list[Any] = []
    for i in range(len(observers)):
        acc = None
        for rank_observers in gathered:
            theirs = rank_observers[i]
            if theirs is None:
                continue
            acc = theirs if acc is None else acc.merge(theirs)
        merged.append(acc)
    return merged


def distributed_world() -> int:
    """Processes in the initialised default group (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
