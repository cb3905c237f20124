"""Writing a benchmark's results file: the one tail every table-producing benchmark shares."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from netquant.atomic import write_text_atomic


def publish(path: Path, lines: Sequence[str]) -> str:
    """Join `lines`, write them to `path` whole or not at all (its folder created), print and return the text."""
    text = "\n".join(lines) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, text)
    print(text)
    return text
