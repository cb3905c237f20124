"""Per-layer error tables: a rich table for the terminal, markdown for files."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from netquant.analysis.layer_error import HEADER, LayerError


def worst(errors: Sequence[LayerError], n: int = 10) -> list[LayerError]:
    """The n op outputs with the lowest SNR."""
    return sorted(errors, key=lambda e: e.snr_db)[:n]


def rich_table(errors: Sequence[LayerError], title: str = "per-layer quantization error") -> Table:
    table = Table(title=title)
    for h in HEADER:
        table.add_column(h, justify="right" if h not in ("op", "type", "quant") else "left")
    for e in errors:
        table.add_row(*e.row())
    return table


def markdown_table(errors: Sequence[LayerError]) -> str:
    """GitHub markdown table, one row per op output; '|' inside a cell (e.g. 'max |err|') is escaped."""
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    lines = [line(HEADER), "|" + "---|" * len(HEADER)] + [line(e.row()) for e in errors]
    return "\n".join(lines) + "\n"
