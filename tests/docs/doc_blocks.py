"""The ```python and ```bash blocks of README.md and docs/*.md, with their doc-test markers.

Convention (an HTML comment on the line(s) before a block, blank lines allowed between):

    <!-- doc-test: setup=NAME -->       run the block on setup NAME of tests/docs/fixtures.py (default tiny_cnn)
    <!-- doc-test: skip REASON -->      do not run it (only for set-up / install commands and long benchmarks)
    <!-- doc-test: slow REASON -->      run it only with `pytest -m slow` (minutes: the demo, real models)

Every python / bash block runs (tests/docs/test_docs_examples.py) unless marked skip with a reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LANGUAGES = ("python", "bash")
_MARK = re.compile(r"<!--\s*doc-test:\s*(?P<body>.*?)\s*-->")
_FENCE = re.compile(r"^```(?P<lang>[\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced code block: where it is, its language and code, and its doc-test marker."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    setup: str | None = None
    skip: str | None = None  # the reason, when marked skip
    slow: str | None = None  # the reason, when marked slow

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _marker(body: str, where: str) -> dict[str, str]:
    key, _, rest = body.partition(" ")
    if key.startswith("setup="):
        return {"setup": key.removeprefix("setup=")}
    if key in ("skip", "slow"):
        if not rest.strip():
            raise ValueError(f"{where}: '<!-- doc-test: {key} -->' needs a reason")
        return {key: rest.strip()}
    raise ValueError(f"{where}: unknown doc-test marker '{body}' (setup=NAME, skip REASON, slow REASON)")


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one markdown file in order (every language; see LANGUAGES for those run)."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out: list[Block] = []
    pending: dict[str, str] = {}
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            mark = _MARK.search(lines[i])
            if mark is not None:
                pending.update(_marker(mark.group("body"), f"{path.name}:{i + 1}"))
            elif lines[i].strip():
                pending = {}  # a marker belongs to the block right after it
            i += 1
            continue
        start = i
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        out.append(Block(path, start + 1, m.group("lang").lower(), "\n".join(body) + "\n", **pending))
        pending = {}
        i += 1
    return out


def doc_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def runnable_blocks() -> list[Block]:
    return [b for p in doc_files() for b in blocks(p) if b.lang in LANGUAGES]


def shell_commands(code: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, comment-only and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", code)
    return [line.strip() for line in joined.splitlines() if line.strip() and not line.strip().startswith("#")]
