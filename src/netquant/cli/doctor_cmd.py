"""`netquant doctor`: this machine's CPU, the int8 kernel family its onnxruntime uses, and package versions."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from netquant.cli.common import friendly_errors


@click.command()
@friendly_errors
def doctor() -> None:
    """Print the CPU, its int8 flags, onnxruntime's int8 arithmetic here (probed) and versions, for bug reports."""
    from netquant.platforms.targets import CpuTarget, host_info, needs_saturation_free_weights

    host = host_info()
    table = Table(title="netquant doctor", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in host.lines():
        table.add_row(key, value)
    Console().print(table)
    if needs_saturation_free_weights(host.target):
        Console().print("Files quantized with full-range int8 weights (--target x86-vnni / arm64) give wrong results "
                        f"on this machine; the default --target {CpuTarget.ANY.value} is safe here.", highlight=False)
