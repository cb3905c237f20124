"""Every single-node ONNX backend case (onnx.backend.test.case.node) run straight through the op registry,
grouped by op type: each op type we implement passes all of its cases.

(The `*_expanded` composite cases and control flow run through the full executor in
tests/graph/test_backend_node.py.)  Cases whose reference came from numpy's random generator and cases
needing string tensors are excluded; cases needing a subgraph runner are covered there too.
"""

from __future__ import annotations

import warnings
from collections import defaultdict

import numpy as np
import onnx
import pytest

from netquant.graph.ops.registry import supported_op_types
from tests.helpers.node_harness import Skip, check_case

RANDOM_CASES = ("test_bernoulli", "test_training_dropout", "test_dropout_random")
NEEDS_SUBGRAPH = {"If", "Loop", "Scan", "SequenceMap"}

DOMAINS = ("", "ai.onnx.ml", "com.microsoft", "ai.onnx.preview.training", "ai.onnx.preview")


def _cases_by_op() -> dict[str, list]:
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        cases = collect_testcases()
    supported = {t for d in DOMAINS for t in supported_op_types(d)}
    groups: dict[str, list] = defaultdict(list)
    for case in cases:
        nodes = case.model.graph.node
        if len(nodes) != 1 or case.name.startswith(RANDOM_CASES):
            continue
        op = nodes[0].op_type
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in nodes[0].attribute):
            continue  # subgraphs need the executor's runner
        if op in supported and op not in NEEDS_SUBGRAPH:
            groups[op].append(case)
    return dict(sorted(groups.items()))


CASES = _cases_by_op()


def test_coverage() -> None:
    assert len(CASES) >= 150, len(CASES)
    assert sum(len(v) for v in CASES.values()) >= 1000


@pytest.mark.parametrize("op_type", list(CASES))
def test_op_type_passes_its_backend_cases(op_type: str) -> None:
    failures, ran = [], 0
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        for case in CASES[op_type]:
            try:
                check_case(case)
                ran += 1
            except Skip as e:
                assert "string" in str(e), f"{case.name}: unexpected skip {e}"
            except AssertionError as e:
                failures.append(f"{case.name}: {str(e)[:300]}")
    assert not failures, "\n".join(failures)
    assert ran or op_type in ("LabelEncoder",), f"{op_type}: no case ran"
