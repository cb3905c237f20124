"""`netquant` command line: quantize, platforms, demo, doctor.

Importing this module loads click and nothing heavy: each command's module (and torch) loads when the command runs,
inside the group's Ctrl-C handler, so an interrupt at any point is one line and exit status 130, never a traceback.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from typing import Any

import click

from netquant import __version__

INTERRUPTED = 130  # 128 + SIGINT, what shells report for a command ended by Ctrl-C

# command name -> (module, attribute): imported when the command runs or its help is shown
COMMANDS = {"quantize": ("netquant.cli.quantize_cmd", "quantize"),
            "platforms": ("netquant.cli.platforms_cmd", "platforms"),
            "demo": ("netquant.cli.demo_cmd", "demo"),
            "doctor": ("netquant.cli.doctor_cmd", "doctor")}


@contextlib.contextmanager
def _interrupts() -> Iterator[None]:
    """KeyboardInterrupt -> one line on stderr and click's exit with status 130 (partial outputs are removed by
    netquant.atomic on the way out)."""
    try:
        yield
    except KeyboardInterrupt:
        sys.stderr.write("\nnetquant: interrupted (Ctrl-C)\n")
        sys.stderr.flush()
        raise click.exceptions.Exit(INTERRUPTED) from None


class _Group(click.Group):
    """The command group: commands imported on first use, Ctrl-C anywhere ends the run with status 130."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*COMMANDS, *super().list_commands(ctx)})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in COMMANDS and cmd_name not in self.commands:
            module, attr = COMMANDS[cmd_name]
            with _interrupts():
                self.add_command(getattr(importlib.import_module(module), attr), cmd_name)
        return super().get_command(ctx, cmd_name)

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:
        with _interrupts():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:
        with _interrupts():
            return super().invoke(ctx)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="netquant")
def cli() -> None:
    """Quantize neural networks (FP32 -> INT8 / INT4 / FP8) for real inference engines."""


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point."""
    cli.main(args=argv, prog_name="netquant")


if __name__ == "__main__":  # pragma: no cover
    main()
