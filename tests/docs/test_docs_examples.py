"""Every ```python and ```bash example of README.md and docs/*.md runs here, on tiny models in a tmp folder
(tests/docs/fixtures.py; markers: tests/docs/doc_blocks.py). `netquant ...` lines run the CLI in-process
(click's runner) and must exit 0; Python blocks run with the setup's names and must not raise."""

from __future__ import annotations

import re
import shlex
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

from netquant.cli.main import cli
from tests.docs.doc_blocks import LANGUAGES, Block, blocks, doc_files, runnable_blocks, shell_commands
from tests.docs.fixtures import DEFAULT_SETUP, SETUPS

BLOCKS = runnable_blocks()


def _params() -> list[object]:
    out = []
    for b in BLOCKS:
        marks = [pytest.mark.skip(reason=b.skip)] if b.skip else [pytest.mark.slow] if b.slow else []
        out.append(pytest.param(b, id=b.id, marks=marks))
    return out


def run_shell(block: Block) -> None:
    runner = CliRunner()
    for command in shell_commands(block.code):
        args = shlex.split(command, comments=True)
        if args[0] != "netquant":
            pytest.fail(f"{block.id}: '{args[0]}' is not a netquant command; run it here or mark the block "
                        "'<!-- doc-test: skip REASON -->'")
        result = runner.invoke(cli, args[1:], catch_exceptions=False)
        assert result.exit_code == 0, f"{block.id}: `{command}` exited {result.exit_code}:\n{result.output}"


def run_python(block: Block, names: dict[str, object]) -> None:
    code = compile(block.code, block.id, "exec")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(code, names)  # noqa: S102 - the documentation's own example


@pytest.mark.parametrize("block", _params())
def test_doc_example_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setup = block.setup or DEFAULT_SETUP
    assert setup in SETUPS, f"{block.id}: unknown setup '{setup}' (tests/docs/fixtures.py: {', '.join(SETUPS)})"
    monkeypatch.chdir(tmp_path)
    names = SETUPS[setup](tmp_path)
    if block.lang == "bash":
        run_shell(block)
    else:
        run_python(block, names)


def test_every_example_is_run_or_marked() -> None:
    """Each docs page has examples; every block in a run language runs or says why not (skip REASON)."""
    assert len(BLOCKS) >= 10
    skipped = [b for b in BLOCKS if b.skip]
    assert all(b.skip.strip() for b in skipped)
    assert len(skipped) <= 4, [b.id for b in skipped]  # the set-up commands, pip installs and long benchmarks
    for path in doc_files():
        langs = {b.lang for b in blocks(path)}
        assert not langs - set(LANGUAGES) - {"", "text", "toml", "json"}, f"{path}: blocks in {langs}"


def test_readme_starts_with_the_two_setup_commands() -> None:
    """.ci/run runs the README's second command; both stay the first block, exactly."""
    first = blocks(doc_files()[0])[0]
    assert first.lang == "bash" and first.code.splitlines() == [
        "python3 -m venv .venv && .venv/bin/pip install -e '.[test]' && .venv/bin/netquant demo",
        ".venv/bin/pip install -q -e '.[test]' && .venv/bin/python -m pytest",
    ]
    ci = (Path(__file__).resolve().parents[2] / ".ci" / "run").read_text()
    assert first.code.splitlines()[1] in ci


def test_markers_are_parsed(tmp_path: Path) -> None:
    page = tmp_path / "p.md"
    page.write_text("<!-- doc-test: skip installs -->\n\n```bash\npip install x\n```\ntext\n"
                    "<!-- doc-test: setup=none -->\n```python\nx = 1\n```\n```text\nout\n```\n")
    a, b, c = blocks(page)
    assert (a.lang, a.skip, a.line, a.code) == ("bash", "installs", 3, "pip install x\n")
    assert (b.setup, b.skip, c.lang) == ("none", None, "text")
    page.write_text("<!-- doc-test: slow minutes -->\n```bash\nnetquant demo\n```\n")
    (d,) = blocks(page)
    assert (d.slow, d.skip, d.setup) == ("minutes", None, None)
    page.write_text("<!-- doc-test: skip -->\n```bash\nnetquant doctor\n```\n")
    with pytest.raises(ValueError, match="needs a reason"):
        blocks(page)
    assert shell_commands("netquant a \\\n   --b c   # note\n# only a comment\n\nnetquant d\n") == [
        "netquant a  --b c   # note", "netquant d"]


def _anchor(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_and_repository_paths_in_the_docs_exist() -> None:
    root = Path(__file__).resolve().parents[2]
    for page in doc_files():
        text = page.read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if "://" in target:
                continue
            file, _, anchor = target.partition("#")
            linked = (page.parent / file).resolve() if file else page
            assert linked.is_file(), f"{page.name}: link to missing {target}"
            if anchor:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(encoding="utf-8"), flags=re.M)
                assert anchor in {_anchor(h) for h in headings}, f"{page.name}: no heading for #{anchor} in {file}"
        for path in re.findall(r"`((?:benchmarks|src|tests|docs|\.ci)/[\w/.\-]+)`", text):
            assert (root / path).exists(), f"{page.name}: `{path}` does not exist"
