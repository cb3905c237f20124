"""PassManager: run passes in order, checking each one's requires / ensures and timing it."""

from __future__ import annotations

import time
from collections.abc import Sequence

from netquant.errors import ConfigError
from netquant.passes.base import PassBase, PassContext


class PassManager:
    """Runs `passes` in order on a context; progress goes to ctx.progress, wall times to ctx.timings."""

    def __init__(self, passes: Sequence[PassBase], check: bool = True) -> None:
        bad = [p for p in passes if not isinstance(p, PassBase)]
        if bad:
            raise ConfigError(f"passes must be netquant.passes.PassBase instances, got "
                              f"{', '.join(type(p).__name__ for p in bad)}; subclass PassBase and implement run()")
        self.passes = list(passes)
        self.check = check

    def run(self, ctx: PassContext) -> PassContext:
        """Run every pass; PassConditionError if a requires is unmet before a pass or an ensures after it."""
        with ctx.progress:
            ctx.progress.start(len(self.passes))
            for p in self.passes:
                if self.check:
                    p.check(ctx, p.requires, "before")
                ctx.progress.begin(p.name)
                t0 = time.perf_counter()
                p.run(ctx)
                ctx.timings[p.name] = time.perf_counter() - t0
                if self.check:
                    p.check(ctx, p.ensures, "after")
                ctx.progress.end(p.name, ctx.timings[p.name])
            ctx.progress.finish()
        return ctx
