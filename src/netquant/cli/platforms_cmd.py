"""`netquant platforms [NAME]`: the registered platforms, their engines, files and schemes (80 columns)."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from netquant.core.spec import QuantSpec
from netquant.platforms import Platform, get_platform, list_platforms

_GRANULARITY = {"per_tensor": "tensor", "per_channel": "channel", "per_group": "group"}


def short_spec(spec: QuantSpec | None) -> str:
    """'int8 sym/channel', 'uint8 affine/tensor', 'float' (None): a spec in a few characters."""
    if spec is None:
        return "float"
    kind = spec.describe().split(",")[0]
    return f"{kind} {'sym' if spec.symmetric else 'affine'}/{_GRANULARITY.get(spec.granularity.value, '?')}"


def files_text(p: Platform) -> str:
    return " ".join(p.files)


def platforms_table() -> Table:
    """One row per platform: name and aliases, the engine that runs its files, the files (-o suffixes), scheme."""
    table = Table(title="netquant platforms (details: netquant platforms NAME)", show_lines=True, width=80)
    table.add_column("platform (aliases)", no_wrap=True, style="bold")
    table.add_column("engine", overflow="fold", max_width=14)
    table.add_column("-o files", overflow="fold", max_width=12)
    table.add_column("activations / weights", overflow="fold", min_width=21)
    for name in list_platforms():
        p = get_platform(name)
        aliases = f"\n({', '.join(p.aliases)})" if p.aliases else ""
        table.add_row(p.name + aliases, p.engine_name, files_text(p),
                      f"{short_spec(p.activation)}\n{short_spec(p.weight)}")
    return table


def platform_details(p: Platform) -> Table:
    """Everything about one platform, two columns."""
    t = Table(title=f"platform {p.name}", show_header=False, width=80)
    t.add_column("what", style="bold", no_wrap=True)
    t.add_column("value", overflow="fold")
    t.add_row("aliases", ", ".join(p.aliases) or "-")
    t.add_row("engine", p.engine_name)
    t.add_row("files (-o)", files_text(p))
    t.add_row("activations", f"{p.activation.describe()} (observer {p.activation_observer})")
    t.add_row("weights", f"{p.weight.describe()} (observer {p.weight_observer})")
    t.add_row("bias", p.bias.describe() if p.bias is not None else "float")
    if p.wider is not None:
        t.add_row("wider format", p.wider.label)
    t.add_row("quantized ops", ", ".join(p.quantizable_op_types))
    t.add_row("export", f"{p.export_format.value}, opset >= {p.min_opset}")
    if p.description:
        t.add_row("about", p.description)
    return t


@click.command()
@click.argument("name", required=False)
@click.option("--names", is_flag=True, help="Print only the platform names, one a line.")
def platforms(name: str | None, names: bool) -> None:
    """List the platforms (built in, registered, and from installed packages' `netquant.platforms` entry points);
    NAME (or an alias) shows one platform in full."""
    from netquant.cli.common import friendly_errors

    if names:
        for n in list_platforms():
            click.echo(n)
        return
    if name is not None:
        friendly_errors(lambda: Console().print(platform_details(get_platform(name))))()
        return
    Console().print(platforms_table())
