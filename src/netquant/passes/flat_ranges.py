"""Don't-care ranges: below which value does a tensor stop mattering to every consumer?

If every consumer of tensor t is flat for t <= L (Relu, Clip(min), HardSigmoid, hard-swish
x * clip(x + 3, 0, 6) / 6, possibly behind affine ops with constant operands), then clamping t at
L changes no output of the graph.  Calibration then observes max(t, L) instead of t
(netquant.calib.ranges.clamp_for_observation), so the quantization grid is spent on values that
matter (a Conv output feeding hard-swish needs no precision below -3).

    lower_flat(t)      = min over consumers c of flat_below(c, t)      (-inf if any is not flat)
    zero_below(v, t)   = L such that v == 0 whenever t <= L (v computed element-wise from t)
"""

from __future__ import annotations

import math

from netquant.graph import Graph, Node
from netquant.passes.quantizer import GraphIndex

NEG_INF = -math.inf
MAX_DEPTH = 8


def _scalar(index: GraphIndex, name: str) -> float | None:
    c = index.constant(name) if name else None
    if c is None or c.numel() != 1 or not c.is_floating_point():
        return None
    return float(c.reshape(()))


def clip_bounds(index: GraphIndex, node: Node) -> tuple[float, float]:
    """A Clip node's constant (min, max) (-inf / inf where not given or not constant)."""
    if "min" in node.attrs or "max" in node.attrs:  # opset < 11
        return float(node.attrs.get("min", NEG_INF)), float(node.attrs.get("max", math.inf))
    lo = _scalar(index, node.inputs[1]) if len(node.inputs) > 1 and node.inputs[1] else NEG_INF
    hi = _scalar(index, node.inputs[2]) if len(node.inputs) > 2 and node.inputs[2] else math.inf
    return (NEG_INF if lo is None else lo), (math.inf if hi is None else hi)


def _other(node: Node, t: str) -> str | None:
    """The other operand of a binary op whose inputs are (t, other) or (other, t)."""
    if len(node.inputs) != 2 or node.inputs.count(t) != 1:
        return None
    return node.inputs[1] if node.inputs[0] == t else node.inputs[0]


class FlatRanges:
    """Lower flat bounds of tensors, memoized."""

    def __init__(self, graph: Graph, index: GraphIndex | None = None) -> None:
        self.graph = graph
        self.index = index or GraphIndex(graph)
        self._memo: dict[str, float] = {}

    def lower_flat(self, t: str, depth: int = 0) -> float:
        """Largest L with every consumer of t flat for t <= L (-inf if none)."""
        if t in self._memo:
            return self._memo[t]
        if depth > MAX_DEPTH or self.graph.is_graph_output(t):
            return NEG_INF
        consumers = self.index.consumers.get(t, [])
        if not consumers:
            return NEG_INF
        bound = math.inf
        for c in consumers:
            bound = min(bound, self._flat_below(c, t, depth))
            if bound == NEG_INF:
                break
        self._memo[t] = bound
        return bound

    def _flat_below(self, c: Node, t: str, depth: int) -> float:
        op = c.op_type
        if c.inputs and c.inputs[0] == t and op == "Relu":
            return 0.0
        if c.inputs and c.inputs[0] == t and op == "Clip":
            return clip_bounds(self.index, c)[0]
        if c.inputs and c.inputs[0] == t and op == "HardSigmoid":
            alpha, beta = float(c.attrs.get("alpha", 0.2)), float(c.attrs.get("beta", 0.5))
            return -beta / alpha if alpha > 0 else NEG_INF
        if c.inputs and c.inputs[0] == t and op == "HardSwish":
            return -3.0
        if op in ("Mul", "Add", "Sub", "Div"):
            other = _other(c, t)
            if other is None:
                return NEG_INF
            k = _scalar(self.index, other)
            if k is not None:
                out_bound = self.lower_flat(c.outputs[0], depth + 1)
                return _invert_affine(op, k, t_first=c.inputs[0] == t, bound=out_bound)
            if op == "Mul":  # t * g(t): flat (zero) where the gate g is zero
                return self.zero_below(other, t, depth + 1)
        return NEG_INF

    def zero_below(self, v: str, t: str, depth: int) -> float:
        """L with v == 0 whenever t <= L, for v an element-wise function of t (else -inf)."""
        if depth > MAX_DEPTH:
            return NEG_INF
        node = self.index.producer.get(v)
        if node is None:
            return NEG_INF
        op = node.op_type
        x = node.inputs[0] if node.inputs else ""
        if op in ("Relu", "Clip", "HardSigmoid"):
            if op == "Relu":
                threshold = 0.0
            elif op == "Clip":
                lo, _ = clip_bounds(self.index, node)
                if lo != 0.0:
                    return NEG_INF
                threshold = 0.0
            else:
                alpha, beta = float(node.attrs.get("alpha", 0.2)), float(node.attrs.get("beta", 0.5))
                if alpha <= 0:
                    return NEG_INF
                threshold = -beta / alpha
            return self._input_below(x, threshold, t, depth + 1)
        if op in ("Mul", "Div") and len(node.inputs) == 2:
            a, b = node.inputs
            kb = _scalar(self.index, b)
            if kb is not None and kb != 0:  # a * k or a / k: zero exactly where a is
                return self.zero_below(a, t, depth + 1)
            ka = _scalar(self.index, a)
            if op == "Mul" and ka is not None and ka != 0:
                return self.zero_below(b, t, depth + 1)
        return NEG_INF

    def _input_below(self, u: str, threshold: float, t: str, depth: int) -> float:
        """L with u <= threshold whenever t <= L, u = affine chain of t (monotone increasing)."""
        if u == t:
            return threshold
        if depth > MAX_DEPTH:
            return NEG_INF
        node = self.index.producer.get(u)
        if node is None or node.op_type not in ("Add", "Sub", "Mul", "Div") or len(node.inputs) != 2:
            return NEG_INF
        a, b = node.inputs
        src, other, first = (a, b, True) if self._depends(a, t) else (b, a, False)
        k = _scalar(self.index, other)
        if k is None:
            return NEG_INF
        inner = _invert_affine(node.op_type, k, t_first=first, bound=threshold)
        return self._input_below(src, inner, t, depth + 1) if inner != NEG_INF else NEG_INF

    def _depends(self, v: str, t: str, depth: int = 0) -> bool:
        if v == t:
            return True
        node = self.index.producer.get(v)
        if node is None or depth > MAX_DEPTH:
            return False
        return any(i and self._depends(i, t, depth + 1) for i in node.inputs)


def _invert_affine(op: str, k: float, *, t_first: bool, bound: float) -> float:
    """Bound on t from a bound on y = op(t, k) (or op(k, t)); -inf unless y is increasing in t."""
    if bound in (NEG_INF, math.inf):
        return NEG_INF
    if op == "Add":
        return bound - k
    if op == "Sub":
        return bound + k if t_first else NEG_INF  # k - t decreases in t
    if op == "Mul":
        return bound / k if k > 0 else NEG_INF
    if op == "Div":
        return bound * k if (t_first and k > 0) else NEG_INF
    return NEG_INF
