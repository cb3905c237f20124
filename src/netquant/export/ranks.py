"""Tensor ranks of a source graph where ONNX shape inference left them unknown.

onnx shape inference stops at com.microsoft ops (onnxruntime.transformers.optimizer's SkipLayerNormalization,
Attention, BiasGelu, EmbedLayerNormalization, ...), so every value after the first such node has no shape. The
exact ORT rewrites (export.ort_patterns) only need a value's rank, which these ops keep: rank_of follows a value's
producer back through rank-keeping ops (elementwise, normalizations, activations, attention) and MatMul
(max of the two ranks) to a value whose rank is known. Anything else stays unknown (None).
"""

from __future__ import annotations

from netquant.graph.ir import Graph, Node

# output 0 has the rank of input 0 (unary, or an input-0-shaped result)
KEEPS_RANK_OF_INPUT0 = frozenset({
    "Attention", "MultiHeadAttention", "LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization", "BiasGelu", "FastGelu", "Gelu", "QuickGelu", "Relu", "Erf", "Tanh", "Sigmoid",
    "Softmax", "Cast", "Identity", "QuantizeLinear", "DequantizeLinear", "Clip", "Sqrt", "Neg", "Abs", "Exp",
})
# output 0 has the largest rank of its inputs (numpy broadcasting)
BROADCASTS = frozenset({"Add", "Sub", "Mul", "Div", "Pow", "Where", "Max", "Min"})
FIXED_RANK = {"EmbedLayerNormalization": 3}  # [batch, sequence, hidden]
MAX_DEPTH = 64


class RankOf:
    """rank_of(name) for values of `graph`: the known shape's length, else inferred as the module docstring says
    (memoized; None where it cannot tell)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph
        self.producer: dict[str, Node] = {o: n for n in graph.nodes for o in n.outputs if o}
        self.memo: dict[str, int | None] = {}

    def __call__(self, name: str) -> int | None:
        return self._rank(name, MAX_DEPTH)

    def _rank(self, name: str, depth: int) -> int | None:
        if name in self.memo:
            return self.memo[name]
        shape = self.graph.value(name).shape
        rank = len(shape) if shape is not None else (self._inferred(name, depth) if depth > 0 else None)
        self.memo[name] = rank
        return rank

    def _inferred(self, name: str, depth: int) -> int | None:
        node = self.producer.get(name)
        if node is None or not node.inputs or node.outputs[0] != name or node.domain not in ("", "ai.onnx",
                                                                                            "com.microsoft"):
            return None
        if node.op_type in FIXED_RANK and node.domain == "com.microsoft":
            return FIXED_RANK[node.op_type]
        if node.op_type in KEEPS_RANK_OF_INPUT0:
            return self._rank(node.inputs[0], depth - 1)
        if node.op_type in BROADCASTS or node.op_type == "MatMul":
            ranks = [self._rank(i, depth - 1) for i in node.inputs if i]
            if any(r is None for r in ranks) or not ranks:
                return None
            known = [r for r in ranks if r is not None]
            if node.op_type == "MatMul" and min(known) < 2:
                return None
            return max(known)
        return None


__all__ = ["RankOf"]
