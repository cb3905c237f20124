"""Progress reporting for a pass run, kept apart from the passes: quiet, or a rich progress display."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

T = TypeVar("T")


class ProgressReporter:
    """Receives the pass manager's events; this base reports nothing (quiet runs)."""

    def __enter__(self) -> ProgressReporter:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def start(self, total: int) -> None:
        """A run of `total` passes begins."""

    def begin(self, name: str) -> None:
        """Pass `name` begins."""

    def end(self, name: str, seconds: float) -> None:
        """Pass `name` finished after `seconds` of wall time."""

    def finish(self) -> None:
        """The run finished."""

    def track(self, items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
        """Iterate `items` (a pass's inner loop, e.g. calibration batches), reporting each step."""
        yield from items

    @contextmanager
    def stage(self, description: str) -> Iterator[None]:
        """A step of unknown length (placement, export) shown with its elapsed time while it runs."""
        yield


class RichProgress(ProgressReporter):
    """A rich progress display: one bar over the passes, one per tracked loop."""

    def __init__(self, console: Console | None = None) -> None:
        self._progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                  TimeElapsedColumn(), console=console or Console(stderr=True), transient=False)
        self._overall: Any = None

    def __enter__(self) -> RichProgress:
        self._progress.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.__exit__(None, None, None)

    def start(self, total: int) -> None:
        self._overall = self._progress.add_task("PTQ passes", total=total)

    def begin(self, name: str) -> None:
        if self._overall is not None:
            self._progress.update(self._overall, description=f"PTQ: {name}")

    def end(self, name: str, seconds: float) -> None:
        if self._overall is not None:
            self._progress.advance(self._overall)

    def finish(self) -> None:
        if self._overall is not None:
            self._progress.update(self._overall, description="PTQ passes")

    def track(self, items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
        task = self._progress.add_task(description, total=total)
        for item in items:
            yield item
            self._progress.advance(task)
        self._progress.update(task, total=self._progress.tasks[task].completed)

    @contextmanager
    def stage(self, description: str) -> Iterator[None]:
        task = self._progress.add_task(description, total=None)
        try:
            yield
        finally:
            self._progress.update(task, total=1, completed=1)


def make_progress(quiet: bool, console: Console | None = None) -> ProgressReporter:
    """A quiet reporter, or a rich display on stderr (or `console`)."""
    return ProgressReporter() if quiet else RichProgress(console)
