"""`netquant platforms`: the registered platforms and their schemes."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from netquant.platforms import get_platform, list_platforms


def platforms_table() -> Table:
    table = Table(title="netquant platforms", show_lines=True)
    table.add_column("name", no_wrap=True, style="bold")
    for col in ("activations", "weights", "bias", "quantized op types", "export"):
        table.add_column(col, overflow="fold")
    for name in list_platforms():
        p = get_platform(name)
        table.add_row(
            p.name,
            f"{p.activation.describe()}\nobserver: {p.activation_observer}",
            f"{p.weight.describe()}\nobserver: {p.weight_observer}",
            p.bias.describe() if p.bias is not None else "float",
            ", ".join(p.quantizable_op_types),
            f"{p.export_format.value}, opset >= {p.min_opset}",
        )
    return table


@click.command()
@click.option("--names", is_flag=True, help="Print only the platform names, one a line.")
def platforms(names: bool) -> None:
    """List the platforms (built in and registered) with their quantization schemes."""
    if names:
        for name in list_platforms():
            click.echo(name)
        return
    Console().print(platforms_table())
