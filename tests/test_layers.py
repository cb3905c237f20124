"""The architecture's layer rule: each package imports only from the layers below it (docs/architecture.md)."""

from __future__ import annotations

import ast
from pathlib import Path

LAYERS = {"core": 1, "calib": 2, "nn": 3, "graph": 3, "data": 3, "platforms": 4, "passes": 5, "export": 6,
          "analysis": 7, "api": 8, "cli": 8}
SRC = Path(__file__).resolve().parents[1] / "src" / "netquant"


def test_no_package_imports_from_a_layer_above_it() -> None:
    upward = []
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).parts
        if len(parts) < 2 or parts[0] not in LAYERS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("netquant."):
                top = node.module.split(".")[1]
                if LAYERS.get(top, 0) > LAYERS[parts[0]]:
                    upward.append(f"{path.relative_to(SRC)}: {node.module}")
    assert upward == []
