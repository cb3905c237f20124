"""Exact rewrites of a QDQ model so that onnxruntime's QDQ selectors still find their patterns after its other
fusions.

onnxruntime's MatMulAddFusion turns a MatMul with a rank >= 3 input followed by an Add of a 1-D bias into
Reshape -> Gemm -> Reshape. On a QDQ MatMul (DequantizeLinear on both inputs) that rewrite runs first and leaves the
DequantizeLinear nodes in front of a float Gemm: no int8 kernel runs and every run dequantizes the weights again
(BERT-style encoders exported with static shapes ran 2.1x slower than FP32). The fusion accepts only a bias of shape
[N] (or 2-D ones for a 2-D MatMul), so giving the bias the MatMul output's rank, [1, ..., 1, N], keeps the MatMul
apart; the Add broadcasts the same values (exact), and onnxruntime fuses DQ -> MatMul into MatMulIntegerToFloat.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import onnx


def _initializer_rank1(graph: onnx.GraphProto, name: str) -> onnx.TensorProto | None:
    for t in graph.initializer:
        if t.name == name:
            return t if len(t.dims) == 1 else None
    return None


def _source_rank(name: str, producer: dict[str, onnx.NodeProto], rank_of: Callable[[str], int | None]) -> int:
    """rank_of the tensor a chain of Q / Clip / DQ nodes ending in `name` started from (0 when unknown)."""
    for _ in range(4):
        rank = rank_of(name)
        if rank is not None:
            return rank
        node = producer.get(name)
        if node is None or node.op_type not in ("DequantizeLinear", "QuantizeLinear", "Clip"):
            return 0
        name = node.input[0]
    return 0


def keep_qdq_matmul_bias_apart(model: onnx.ModelProto, rank_of: Callable[[str], int | None]) -> int:
    """Reshape the 1-D bias of every Add that follows a QDQ MatMul (both inputs from DequantizeLinear) with an input
    of rank >= 3 to [1, ..., 1, N] (the MatMul output's rank), in place; returns how many biases were reshaped.

    rank_of: the rank of a tensor of the source graph by name, None when unknown (such MatMuls are left alone); the
    MatMul's input is traced back through its DequantizeLinear / Clip / QuantizeLinear to the source tensor. A bias
    that other nodes also read gets a reshaped copy of its own."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            readers[i].append(n)
    outputs = {o.name for o in graph.output}
    taken = {t.name for t in graph.initializer} | set(producer) | {i.name for i in graph.input}
    changed = 0
    for mm in list(graph.node):
        if mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx") or len(mm.input) != 2:
            continue
        if any(getattr(producer.get(i), "op_type", None) != "DequantizeLinear" for i in mm.input):
            continue
        rank = _source_rank(mm.input[0], producer, rank_of)
        users = readers.get(mm.output[0], [])
        if rank < 3 or len(users) != 1 or mm.output[0] in outputs or users[0].op_type != "Add":
            continue
        add = users[0]
        index = 1 if add.input[0] == mm.output[0] else 0
        bias = _initializer_rank1(graph, add.input[index])
        if bias is None:
            continue
        dims = [1] * (rank - 1) + [int(bias.dims[0])]
        if len(readers[bias.name]) == 1:
            del bias.dims[:]
            bias.dims.extend(dims)
        else:
            name, k = f"{bias.name}_rank{rank}", 1
            while name in taken:
                name, k = f"{bias.name}_rank{rank}_{k}", k + 1
            taken.add(name)
            copy = onnx.TensorProto()
            copy.CopyFrom(bias)
            copy.name = name
            del copy.dims[:]
            copy.dims.extend(dims)
            graph.initializer.append(copy)
            add.input[index] = name
        changed += 1
    if changed:  # value_info of a reshaped bias (if any) no longer holds
        keep = [v for v in graph.value_info if v.name not in {t.name for t in graph.initializer}]
        del graph.value_info[:]
        graph.value_info.extend(keep)
    return changed


__all__ = ["keep_qdq_matmul_bias_apart"]
