"""The `netquant` command on interrupts and environment trouble (issue 19: Ctrl-C while torch loaded printed a
traceback)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import onnx
import pytest

from tests.helpers.found_models import gray_conv

SRC = Path(__file__).resolve().parents[2] / "src"

# a Ctrl-C that arrives while `module` is being imported (a finder ahead of the real ones raises it), then the CLI
INTERRUPT_DURING_IMPORT = r'''
import sys
class CtrlC:
    def find_spec(self, name, path=None, target=None):
        if name == sys.argv[1]:
            raise KeyboardInterrupt
        return None
sys.meta_path.insert(0, CtrlC())
from netquant.cli.main import main
main(sys.argv[2:])
'''


def _run(code: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(SRC), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})


def test_importing_the_cli_loads_no_torch() -> None:
    """The console script's own import is light, so an interrupt while torch loads happens inside main()."""
    result = _run("import sys, netquant, netquant.cli.main; print(sorted({'torch', 'numpy', 'onnx'} & set(sys.modules)))")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize("module", ["torch", "onnxruntime", "rich"])
def test_ctrl_c_while_importing_exits_130_with_one_line(tmp_path: Path, module: str) -> None:
    onnx.save(gray_conv(), tmp_path / "m.onnx")
    out = tmp_path / "q.onnx"
    result = _run(INTERRUPT_DURING_IMPORT, module, "quantize", tmp_path / "m.onnx", "--calib", "random", "-o", out, "-q")
    assert result.returncode == 130, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines == ["netquant: interrupted (Ctrl-C)"], result.stderr
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["m.onnx"]


def test_lazy_package_names_still_resolve() -> None:
    import netquant
    from netquant.core.spec import QuantSpec

    assert netquant.QuantSpec is QuantSpec and "quantize_onnx" in dir(netquant)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        netquant.nope  # noqa: B018
