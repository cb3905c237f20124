"""Interleaved wall-clock timing: the one loop every latency comparison (placement, benchmarks) uses."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence


def interleaved_ms(calls: Sequence[Callable[[], object]], *, per_round: int, rounds: int = 5,
                   warmup: int = 3, settled: Callable[[list[float]], bool] | None = None,
                   min_rounds: int = 3) -> list[float]:
    """Median ms of one call of each of `calls`: `warmup` untimed calls each, then `rounds` rounds in which every call
    runs `per_round` times in turn, so that changes in machine load hit them alike.
    settled: stop after any round from `min_rounds` on where settled(the medians so far) holds (a clear verdict)."""
    for call in calls:
        for _ in range(warmup):
            call()
    times: list[list[float]] = [[] for _ in calls]
    for r in range(rounds):
        for i, call in enumerate(calls):
            for _ in range(max(1, per_round)):
                t = time.perf_counter()
                call()
                times[i].append(time.perf_counter() - t)
        if settled is not None and r + 1 >= min_rounds and r + 1 < rounds and \
                settled([1000.0 * statistics.median(t) for t in times]):
            break
    return [1000.0 * statistics.median(t) for t in times]
