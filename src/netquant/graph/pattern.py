"""A small pattern matcher over op chains, e.g. Conv -> BatchNormalization -> Relu."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from netquant.graph.ir import Graph, Node

# one chain element: "Conv", "Relu|Clip", {"Relu", "Clip"}, or a predicate on the node
OpPattern = str | Iterable[str] | Callable[[Node], bool]


def _matcher(pattern: OpPattern) -> Callable[[Node], bool]:
    if callable(pattern):
        return pattern
    types = set(pattern.split("|")) if isinstance(pattern, str) else set(pattern)
    return lambda node: node.op_type in types


def match_chains(graph: Graph, pattern: Sequence[OpPattern], *, overlap: bool = False) -> list[list[Node]]:
    """Chains n0 -> n1 -> ... where n_k matches pattern[k] and n_{k+1} is the only reader of n_k's
    first output (which is no graph output), so the chain can be fused or rewritten as a unit.

    Matches are returned in topological order of their first node; without `overlap`, a node
    belongs to at most one match (earliest wins).
    """
    if not pattern:
        return []
    matchers = [_matcher(p) for p in pattern]
    readers: dict[str, list[Node]] = {}
    for node in graph.nodes:
        for name in set(node.inputs):
            if name:
                readers.setdefault(name, []).append(node)
        for sub in node.subgraphs():
            for name in sub.free_values():
                readers.setdefault(name, []).append(node)
    outputs = set(graph.output_names)
    used: set[int] = set()
    found: list[list[Node]] = []
    for start in graph.nodes:
        if not matchers[0](start) or (not overlap and id(start) in used):
            continue
        chain = [start]
        for match in matchers[1:]:
            last = chain[-1]
            if not last.outputs or last.outputs[0] in outputs:
                break
            nxt = readers.get(last.outputs[0], [])
            if len(nxt) != 1 or not match(nxt[0]) or (not overlap and id(nxt[0]) in used):
                break
            chain.append(nxt[0])
        if len(chain) == len(matchers):
            found.append(chain)
            if not overlap:
                used.update(id(n) for n in chain)
    return found
