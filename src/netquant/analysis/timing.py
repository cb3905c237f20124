"""Interleaved wall-clock timing: the one loop every latency comparison (placement, benchmarks) uses."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class InterleavedTimes:
    """Every timed run of interleaved calls: runs_ms[i][r] holds call i's runs (ms) in round r."""

    runs_ms: tuple[tuple[tuple[float, ...], ...], ...]

    def median_ms(self) -> list[float]:
        """Per call: the median of all its runs."""
        return [statistics.median(t for rnd in call for t in rnd) for call in self.runs_ms]

    def fastest_ms(self) -> list[float]:
        """Per call: its fastest single run (what a quiet machine gives, on a host whose load only adds time)."""
        return [min(t for rnd in call for t in rnd) for call in self.runs_ms]


def interleaved_times(calls: Sequence[Callable[[], object]], *, per_round: int, rounds: int = 5,
                      warmup: int = 3, settled: Callable[[InterleavedTimes], bool] | None = None,
                      min_rounds: int = 3) -> InterleavedTimes:
    """Every run of each of `calls`: `warmup` untimed calls each, then `rounds` rounds in which every call runs
    `per_round` times in turn, so that changes in machine load hit them alike. Round r starts at call r mod n (the
    order rotates: no call always follows the same one or always opens a round).
    settled: stop after any round from `min_rounds` on where settled(the runs so far) holds (a clear verdict)."""
    for call in calls:
        for _ in range(warmup):
            call()
    times: list[list[tuple[float, ...]]] = [[] for _ in calls]
    for r in range(rounds):
        for k in range(len(calls)):
            i = (r + k) % len(calls)
            this_round = []
            for _ in range(max(1, per_round)):
                t = time.perf_counter()
                calls[i]()
                this_round.append(1000.0 * (time.perf_counter() - t))
            times[i].append(tuple(this_round))
        if settled is not None and min_rounds <= r + 1 < rounds and \
                settled(InterleavedTimes(tuple(tuple(t) for t in times))):
            break
    return InterleavedTimes(tuple(tuple(t) for t in times))


def interleaved_ms(calls: Sequence[Callable[[], object]], *, per_round: int, rounds: int = 5,
                   warmup: int = 3, settled: Callable[[list[float]], bool] | None = None,
                   min_rounds: int = 3) -> list[float]:
    """Median ms of one call of each of `calls` (interleaved_times' median_ms; settled sees the medians)."""
    on_medians = None if settled is None else (lambda runs: settled(runs.median_ms()))
    return interleaved_times(calls, per_round=per_round, rounds=rounds, warmup=warmup, settled=on_medians,
                             min_rounds=min_rounds).median_ms()
