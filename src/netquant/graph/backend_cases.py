"""Run ONNX's backend node test cases (onnx.backend.test.case.node.collect_testcases) against the executor
and sort the outcome per op type.

A case is *claimed* when every op type in its model is implemented.  Claimed cases are skipped only for
reasons documented in SKIP_REASONS (string tensors, outputs drawn from numpy's random generator);
everything else claimed must pass.
"""

from __future__ import annotations

import fnmatch
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import onnx

from netquant.graph.backend import run_node_testcase

# case-name patterns skipped even when all their ops are implemented, and why
SKIP_REASONS: dict[str, str] = {
    "test_bernoulli*": "reference output drawn from numpy's random generator; not reproducible in torch",
    "test_training_dropout": "training-mode dropout mask drawn from numpy's random generator",
    "test_training_dropout_default": "training-mode dropout mask drawn from numpy's random generator",
    "test_training_dropout_mask": "training-mode dropout mask drawn from numpy's random generator",
    "test_training_dropout_default_mask": "training-mode dropout mask drawn from numpy's random generator",
}
STRING_REASON = "string tensors (torch has no string dtype)"


class Status(StrEnum):
    PASSED = "passed"
    FAILED = "failed"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class CaseResult:
    name: str
    op_type: str        # the op the case is about (the one node, or the op an *_expanded case expands)
    op_types: frozenset[str]
    status: Status
    message: str


def model_op_types(model: onnx.ModelProto) -> set[str]:
    """Op types of every node, subgraphs included (domain-qualified outside ai.onnx)."""
    found: set[str] = set()

    def walk(graph: onnx.GraphProto) -> None:
        for node in graph.node:
            dom = node.domain if node.domain not in ("", "ai.onnx") else ""
            found.add(f"{dom}:{node.op_type}" if dom else node.op_type)
            for attr in node.attribute:
                if attr.type == onnx.AttributeProto.GRAPH:
                    walk(attr.g)
                for g in attr.graphs:
                    walk(g)

    walk(model.graph)
    return found


def _uses_strings(case: Any) -> bool:
    for inputs, outputs in case.data_sets or []:
        for arr in (*inputs, *outputs):
            if isinstance(arr, np.ndarray) and arr.dtype == object:
                return True
            if isinstance(arr, list) and any(isinstance(a, np.ndarray) and a.dtype == object for a in arr):
                return True
    def has_string_type(vi: onnx.ValueInfoProto) -> bool:
        return "elem_type: 8\n" in str(vi.type)
    return any(has_string_type(v) for v in (*case.model.graph.input, *case.model.graph.output))


def skip_reason(case: Any, supported: set[str]) -> str | None:
    missing = sorted(model_op_types(case.model) - supported)
    if missing:
        return f"op type(s) not implemented: {', '.join(missing)}"
    for pattern, reason in SKIP_REASONS.items():
        if fnmatch.fnmatchcase(case.name, pattern):
            return reason
    if _uses_strings(case):
        return STRING_REASON
    return None


def _primary_ops(cases: list[Any]) -> dict[str, str]:
    """case name -> op type it tests."""
    single = {c.name: c.model.graph.node[0].op_type for c in cases if len(c.model.graph.node) == 1}
    result: dict[str, str] = {}
    for c in cases:
        if c.name in single:
            result[c.name] = single[c.name]
            continue
        base = re.sub(r"_expanded(_ver\d+)?$", "", c.name)
        base = base.replace("_expanded", "")
        if base in single:
            result[c.name] = single[base]
            continue
        counts = Counter(n.op_type for n in c.model.graph.node)
        # name-based guess: the longest op type whose snake_case prefixes the case name
        snake = {re.sub(r"(?<!^)(?=[A-Z])", "_", t).lower(): t for t in counts}
        guess = [t for s, t in snake.items() if c.name.startswith(f"test_{s}")]
        result[c.name] = max(guess, key=len) if guess else counts.most_common(1)[0][0]
    return result


def run_all_cases(supported: set[str] | None = None, pattern: str | None = None) -> list[CaseResult]:
    """Run every backend node case (optionally only names matching a glob)."""
    from onnx.backend.test.case.node import collect_testcases

    from netquant.graph import supported_ops

    if supported is None:
        supported = set(supported_ops()) | {
            f"{d}:{t}" for d in ("ai.onnx.ml", "com.microsoft", "ai.onnx.preview", "ai.onnx.preview.training")
            for t in supported_ops(d)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = [c for c in collect_testcases() if c.kind == "node"]
    if pattern:
        cases = [c for c in cases if fnmatch.fnmatchcase(c.name, pattern)]
    primary = _primary_ops(cases)
    results = []
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        for case in cases:
            ops = frozenset(model_op_types(case.model))
            reason = skip_reason(case, supported)
            if reason is not None:
                results.append(CaseResult(case.name, primary[case.name], ops, Status.SKIPPED, reason))
                continue
            ok, msg = run_node_testcase(case)
            results.append(CaseResult(case.name, primary[case.name], ops,
                                      Status.PASSED if ok else Status.FAILED, msg))
    return results


def per_op_table(results: list[CaseResult]) -> dict[str, Counter[str]]:
    table: dict[str, Counter[str]] = {}
    for r in results:
        table.setdefault(r.op_type, Counter())[r.status.value] += 1
    return dict(sorted(table.items()))
