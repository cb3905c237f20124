"""Run PTQ passes in order, with a rich progress display (or quietly)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class Pass(Protocol):
    """One step of the PTQ pipeline."""

    name: str

    def run(self, ctx: PassContext) -> None: ...


@dataclass
class PassContext:
    """State shared by the passes of one run."""

    settings: Any  # netquant.passes.settings.QuantSettings
    graph: Any = None  # netquant.graph.Graph (cleaned up in place)
    qgraph: Any = None  # netquant.passes.quant_graph.QuantizedGraph once built
    calib_data: Any = None  # netquant.passes.calib_data.CalibrationData
    progress: Progress | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def track(self, items: Iterable[Any], description: str, total: int | None = None) -> Iterable[Any]:
        """Iterate `items`, advancing a progress bar unless quiet."""
        if self.progress is None:
            yield from items
            return
        task = self.progress.add_task(description, total=total)
        for item in items:
            yield item
            self.progress.advance(task)
        self.progress.update(task, total=self.progress.tasks[task].completed)


def make_progress(quiet: bool, console: Console | None = None) -> Progress | None:
    if quiet:
        return None
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console or Console(stderr=True), transient=False)


def run_passes(passes: Sequence[Pass], ctx: PassContext,
               on_done: Callable[[str, float], None] | None = None) -> PassContext:
    """Run each pass in order; records wall time per pass in ctx.timings."""
    cm: AbstractContextManager[Any] = ctx.progress if ctx.progress is not None else nullcontext()
    with cm:
        overall = ctx.progress.add_task("PTQ passes", total=len(passes)) if ctx.progress else None
        for p in passes:
            if ctx.progress is not None and overall is not None:
                ctx.progress.update(overall, description=f"PTQ: {p.name}")
            t0 = time.perf_counter()
            p.run(ctx)
            ctx.timings[p.name] = time.perf_counter() - t0
            if on_done is not None:
                on_done(p.name, ctx.timings[p.name])
            if ctx.progress is not None and overall is not None:
                ctx.progress.advance(overall)
        if ctx.progress is not None and overall is not None:
            ctx.progress.update(overall, description="PTQ passes")
    return ctx
