"""Registry of ONNX op implementations in torch.

Contract for every implementation:

    @register_op("Conv")                       # domain "" (ai.onnx) by default
    def conv(inputs: list[torch.Tensor | None], attrs: dict[str, Any], ctx: OpContext) -> list[torch.Tensor]

- `inputs` follow the node's input order; an omitted optional input is None.
- `attrs` hold python values as decoded by `decode_attribute`: int, float, str (utf-8 decoded),
  torch.Tensor (TENSOR), lists of those, and subgraphs (GRAPH) as whatever the executor passes
  (ops that need subgraphs call `ctx.run_subgraph`).  Absent attributes are absent: use
  attrs.get(name, default) with the default from the ONNX spec.
- Return one tensor per node output (fewer only if trailing optional outputs are unused; return
  exactly `ctx.num_outputs` when possible).
- Raise `UnsupportedOpError(ctx.unsupported(...))` for a mode/attribute/opset not handled.
- Implementations must be differentiable torch code where the math is (so autograd flows).
- `since`: lowest opset this implementation covers; use `versions=(a, b)` to register a second
  implementation for opsets where semantics changed (lookup picks the newest `since` <= opset).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from netquant.errors import UnsupportedOpError

OpFn = Callable[[list["torch.Tensor | None"], dict[str, Any], "OpContext"], Sequence[torch.Tensor]]


@dataclass
class OpContext:
    """What an op implementation may know besides its inputs and attributes."""

    op_type: str
    name: str = ""
    domain: str = ""
    opset: int = 21
    num_outputs: int = 1
    # Runs a subgraph (If / Loop / Scan bodies): run_subgraph(graph, inputs: list[Tensor]) -> list[Tensor]
    run_subgraph: Callable[[Any, list[torch.Tensor], dict[str, torch.Tensor]], list[torch.Tensor]] | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    def unsupported(self, what: str) -> str:
        """Message for an unsupported feature of this node."""
        return (f"{self.op_type} node '{self.name or '<unnamed>'}' (domain '{self.domain or 'ai.onnx'}', "
                f"opset {self.opset}): {what} is not supported by netquant's executor")


@dataclass(frozen=True)
class OpImpl:
    op_type: str
    domain: str
    since: int
    fn: OpFn


_REGISTRY: dict[tuple[str, str], list[OpImpl]] = {}


def _norm_domain(domain: str) -> str:
    return "" if domain in ("", "ai.onnx") else domain


def register_op(op_type: str, *, domain: str = "", since: int = 1) -> Callable[[OpFn], OpFn]:
    """Decorator registering `fn` as the implementation of op_type for opsets >= since."""

    def deco(fn: OpFn) -> OpFn:
        impls = _REGISTRY.setdefault((_norm_domain(domain), op_type), [])
        impls.append(OpImpl(op_type, _norm_domain(domain), since, fn))
        impls.sort(key=lambda i: i.since)
        return fn

    return deco


def lookup_op(op_type: str, domain: str = "", opset: int = 21, node_name: str = "") -> OpFn:
    """The implementation for op_type at this opset, or UnsupportedOpError naming the node."""
    impls = _REGISTRY.get((_norm_domain(domain), op_type))
    if not impls:
        raise UnsupportedOpError(
            f"op type '{op_type}' (domain '{domain or 'ai.onnx'}', node '{node_name or '<unnamed>'}', "
            f"opset {opset}) is not supported by netquant's executor; supported types: "
            f"see netquant.graph.supported_ops()")
    chosen = [i for i in impls if i.since <= opset]
    return (chosen[-1] if chosen else impls[0]).fn


def supported_op_types(domain: str = "") -> list[str]:
    """Sorted op types registered for a domain."""
    d = _norm_domain(domain)
    return sorted(t for (dom, t) in _REGISTRY if dom == d)
