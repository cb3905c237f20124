"""analysis.timing.interleaved_ms: the warm-up, the round-robin order (rotating by round) and the medians."""

from __future__ import annotations

import time

from netquant.analysis.timing import InterleavedTimes, interleaved_ms, interleaved_times


def test_calls_alternate_round_by_round_after_their_warmup():
    order: list[str] = []
    calls = [lambda: order.append("a"), lambda: order.append("b")]
    ms = interleaved_ms(calls, per_round=2, rounds=3, warmup=1)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] + ["b", "b", "a", "a"] + ["a", "a", "b", "b"]
    assert len(ms) == 2 and all(m >= 0 for m in ms)


def test_round_r_starts_at_call_r_mod_n_and_runs_are_kept_by_call():
    order: list[str] = []
    calls = [lambda name=name: order.append(name) for name in "abc"]
    runs = interleaved_times(calls, per_round=1, rounds=4, warmup=0)
    assert order == list("abc" "bca" "cab" "abc")
    assert [len(call) for call in runs.runs_ms] == [4, 4, 4]


def test_medians_in_milliseconds():
    ms = interleaved_ms([lambda: time.sleep(0.004), lambda: None], per_round=3, rounds=2, warmup=0)
    assert 3.5 <= ms[0] <= 50 and ms[1] < 1.0


def test_settled_stops_after_min_rounds_once_the_verdict_is_clear():
    order: list[str] = []
    seen: list[list[float]] = []

    def settled(medians: list[float]) -> bool:
        seen.append(medians)
        return True

    calls = [lambda: order.append("a"), lambda: order.append("b")]
    interleaved_ms(calls, per_round=1, rounds=5, warmup=0, settled=settled, min_rounds=3)
    assert order == ["a", "b", "b", "a", "a", "b"] and len(seen) == 1 and len(seen[0]) == 2  # asked after round 3


def test_interleaved_times_settled_sees_every_run_so_far():
    seen: list[InterleavedTimes] = []

    def settled(runs: InterleavedTimes) -> bool:
        seen.append(runs)
        return len(seen) == 2

    runs = interleaved_times([lambda: None, lambda: None], per_round=2, rounds=6, warmup=0, settled=settled,
                             min_rounds=2)
    assert [len(s.runs_ms[0]) for s in seen] == [2, 3] and len(runs.runs_ms[1]) == 3  # stopped after round 3


def test_unsettled_verdict_runs_every_round():
    order: list[str] = []
    calls = [lambda: order.append("a"), lambda: order.append("b")]
    interleaved_ms(calls, per_round=1, rounds=5, warmup=0, settled=lambda m: False, min_rounds=3)
    assert order == ["a", "b", "b", "a"] * 2 + ["a", "b"]


def test_every_run_kept_by_call_and_round_with_medians_and_fastest_runs():
    runs = InterleavedTimes((((10.0, 12.0), (20.0, 22.0), (11.0, 11.0)),
                             ((5.0, 5.0), (12.0, 10.0), (4.0, 6.0))))
    assert runs.median_ms() == [11.5, 5.5]  # medians of 6 runs: (11 + 12) / 2 and (5 + 6) / 2
    assert runs.fastest_ms() == [10.0, 4.0]


def test_interleaved_times_records_rounds_in_order():
    clock = iter(range(100))
    calls = [lambda: next(clock), lambda: time.sleep(0.002)]
    runs = interleaved_times(calls, per_round=2, rounds=3, warmup=0)
    assert [len(call) for call in runs.runs_ms] == [3, 3] and all(len(r) == 2 for c in runs.runs_ms for r in c)
    assert min(runs.fastest_ms()[1], *runs.median_ms()[1:]) >= 1.5 and runs.median_ms()[0] < 1.0
