"""Per-layer error tables: a rich table for the terminal, markdown for files."""

from __future__ import annotations

from collections.abc import Sequence

from rich.table import Table

from netquant.analysis.layer_error import HEADER, LayerError
from netquant.analysis.saturation import HEADER as SATURATION_HEADER
from netquant.analysis.saturation import SaturationRow


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
    return _markdown(HEADER, [e.row() for e in errors])


def saturation_markdown(rows: Sequence[SaturationRow]) -> str:
    """GitHub markdown table of analysis.saturation rows."""
    return _markdown(SATURATION_HEADER, [r.row() for r in rows])


def _markdown(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    lines = [line(header), "|" + "---|" * len(header)] + [line(r) for r in rows]
    return "\n".join(lines) + "\n"
