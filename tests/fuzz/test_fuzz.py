"""Fuzz tier: seeded malformed / unusual models and data through the loader, executor, quantize_onnx and the CLI.

Every case must end in a result (that onnxruntime agrees with, where it runs the model) or a NetquantError
subclass: never another exception, a hang or a leftover file.  300 cases run by default (a few seconds),
5,000 more with `pytest -m slow`; `python benchmarks/fuzz.py` writes the table of what was tried.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tests.fuzz.fuzzgen import Category, Door, Outcome, make_case, run_cases

DEFAULT_SEEDS, SLOW_SEEDS = range(0, 300), range(300, 5300)
CHUNK = 50


def _check(seeds: range, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the CLI's and the quantizer's own warnings are expected here
        tally = run_cases(seeds, tmp_path)
    report = "\n".join(f"seed {r.case.seed} [{r.case.category.value} via {r.case.door.value}] {r.case.what}: "
                       f"{r.outcome.value} {r.detail}" for r in tally.bad)
    assert list(tmp_path.iterdir()) == []
    assert not tally.bad, f"{len(tally.bad)} of {tally.total} fuzz cases went wrong:\n{report}"


@pytest.mark.parametrize("start", range(DEFAULT_SEEDS.start, DEFAULT_SEEDS.stop, CHUNK))
def test_fuzz_cases_end_in_a_result_or_a_netquant_error(start: int, tmp_path: Path) -> None:
    _check(range(start, start + CHUNK), tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("start", range(SLOW_SEEDS.start, SLOW_SEEDS.stop, 500))
def test_fuzz_thousands_of_cases(start: int, tmp_path: Path) -> None:
    _check(range(start, start + 500), tmp_path)


def test_the_generator_is_seeded_and_covers_every_category_and_door() -> None:
    cases = [make_case(s) for s in DEFAULT_SEEDS]
    again = [make_case(s) for s in DEFAULT_SEEDS]
    assert [(c.category, c.door, c.what, c.model) for c in cases] == [(c.category, c.door, c.what, c.model)
                                                                      for c in again]
    assert {c.category for c in cases} == set(Category)
    assert {c.door for c in cases} == set(Door)


def test_valid_cases_give_results_and_truncated_ones_netquant_errors(tmp_path: Path) -> None:
    """The classification is not vacuous: valid models really run (and export), broken bytes really fail."""
    from tests.fuzz.fuzzgen import run_case

    valid = [c for c in map(make_case, DEFAULT_SEEDS) if c.category is Category.VALID][:6]
    truncated = [c for c in map(make_case, DEFAULT_SEEDS) if c.category is Category.TRUNCATED][:6]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert {run_case(c, tmp_path).outcome for c in valid} <= {Outcome.OK, Outcome.NETQUANT_ERROR}
        assert sum(run_case(c, tmp_path).outcome is Outcome.OK for c in valid) >= 4
        assert {run_case(c, tmp_path).outcome for c in truncated} == {Outcome.NETQUANT_ERROR}
