"""Exact graph simplifications that matter for quantized inference on CPU engines.

- fold_conv_affine: Conv -> Mul(k) [-> Add(c)] and Conv -> Add(c), with k, c constants broadcast
  per output channel, become one Conv: W' = W k, B' = B k + c.  (PP-LCNet's learnable affine
  blocks, biases exported as a separate Add.)  The Conv output then is the tensor that gets
  quantized, and the engine runs no extra element-wise passes.
- decomposed hard-swish x * clip(x + 3, 0, 6) / 6 -> x * HardSigmoid(x; 1/6, 1/2): two
  element-wise ops instead of four, same function.

Every rewrite is exact up to float32 rounding.
"""

from __future__ import annotations

import torch

from netquant.graph import Graph, Node
from netquant.passes.quantizer import GraphIndex


def _const(index: GraphIndex, name: str) -> torch.Tensor | None:
    c = index.constant(name) if name else None
    return c.float() if c is not None and c.is_floating_point() else None


def _per_channel(c: torch.Tensor, channels: int, out_rank: int) -> torch.Tensor | None:
    """c as a (channels,) vector if it broadcasts along dim 1 of a rank-`out_rank` output only."""
    if c.numel() == 1:
        return c.reshape(1).expand(channels).clone()
    shape = list(c.shape)
    if len(shape) > out_rank:
        return None
    shape = [1] * (out_rank - len(shape)) + shape
    if shape[1] != channels or any(s != 1 for i, s in enumerate(shape) if i != 1):
        return None
    return c.reshape(channels).clone()


def _single_consumer(index: GraphIndex, graph: Graph, value: str) -> Node | None:
    cons = index.consumers.get(value, [])
    if len(cons) != 1 or graph.is_graph_output(value):
        return None
    return cons[0]


def _set_init(graph: Graph, base: str, value: torch.Tensor) -> str:
    name = graph.fresh_name(base)
    graph.initializers[name] = value.contiguous()
    return name


def _rank(graph: Graph, value: str) -> int | None:
    shape = graph.value(value).shape
    return len(shape) if shape is not None else None


def fold_conv_affine(graph: Graph) -> int:
    """Fold per-channel Mul / Add constants that follow a Conv into its weight and bias."""
    folded = 0
    changed = True
    while changed:
        changed = False
        index = GraphIndex(graph)
        for conv in list(graph.nodes):
            if conv.op_type != "Conv" or len(conv.inputs) < 2:
                continue
            w = _const(index, conv.inputs[1])
            if w is None:
                continue
            nxt = _single_consumer(index, graph, conv.outputs[0])
            if nxt is None or nxt.op_type not in ("Mul", "Add") or len(nxt.inputs) != 2:
                continue
            other = nxt.inputs[1] if nxt.inputs[0] == conv.outputs[0] else nxt.inputs[0]
            if other == conv.outputs[0]:
                continue
            k = _const(index, other)
            rank = _rank(graph, conv.outputs[0]) or (w.dim())
            vec = _per_channel(k, w.shape[0], rank) if k is not None else None
            if vec is None:
                continue
            bias = _const(index, conv.inputs[2]) if len(conv.inputs) > 2 and conv.inputs[2] else None
            bias = bias if bias is not None else torch.zeros(w.shape[0])
            if nxt.op_type == "Mul":
                new_w = w * vec.reshape(-1, *([1] * (w.dim() - 1)))
                new_b = bias * vec
            else:
                new_w, new_b = w, bias + vec
            conv.inputs[1] = _set_init(graph, f"{conv.inputs[1]}_folded", new_w.to(w.dtype))
            b_name = _set_init(graph, f"{conv.name}_bias_folded", new_b.to(w.dtype))
            if len(conv.inputs) > 2:
                conv.inputs[2] = b_name
            else:
                conv.inputs.append(b_name)
            # the Conv now writes what the Mul / Add wrote
            graph.nodes.remove(nxt)
            graph.value_info.pop(conv.outputs[0], None)
            conv.outputs[0] = nxt.outputs[0]
            folded += 1
            changed = True
            break
    if folded:
        _drop_unused_initializers(graph)
    return folded


def _drop_unused_initializers(graph: Graph) -> None:
    used = {i for n in graph.nodes for i in n.inputs if i} | set(graph.output_names)
    for name in [n for n in graph.initializers if n not in used and n not in graph.input_names]:
        del graph.initializers[name]


def hardswish_to_hardsigmoid(graph: Graph) -> int:
    """Div(Mul(x, Clip(Add(x, 3), 0, 6)), 6) -> Mul(x, HardSigmoid(x, alpha=1/6, beta=0.5))."""
    count = 0
    changed = True
    while changed:
        changed = False
        index = GraphIndex(graph)
        for add in list(graph.nodes):
            if add.op_type != "Add" or len(add.inputs) != 2:
                continue
            three = next((i for i in add.inputs if (c := _const(index, i)) is not None and c.numel() == 1
                          and float(c.reshape(())) == 3.0), None)
            if three is None:
                continue
            x = add.inputs[1] if add.inputs[0] == three else add.inputs[0]
            clip = _single_consumer(index, graph, add.outputs[0])
            if clip is None or clip.op_type != "Clip":
                continue
            from netquant.passes.flat_ranges import clip_bounds

            if clip_bounds(index, clip) != (0.0, 6.0):
                continue
            mul = _single_consumer(index, graph, clip.outputs[0])
            if mul is None or mul.op_type != "Mul" or sorted(mul.inputs) != sorted([x, clip.outputs[0]]):
                continue
            div = _single_consumer(index, graph, mul.outputs[0])
            if div is None or div.op_type != "Div" or div.inputs[0] != mul.outputs[0]:
                continue
            six = _const(index, div.inputs[1])
            if six is None or six.numel() != 1 or float(six.reshape(())) != 6.0:
                continue
            gate = graph.fresh_name(f"{x}_hardsigmoid")
            hs = Node(graph.fresh_name(f"{add.name}_HardSigmoid", {n.name for n in graph.nodes}),
                      "HardSigmoid", inputs=[x], outputs=[gate], attrs={"alpha": 1.0 / 6.0, "beta": 0.5})
            out = div.outputs[0]
            new_mul = Node(mul.name, "Mul", inputs=[x, gate], outputs=[out])
            idx = graph.nodes.index(add)
            for n in (div, mul, clip, add):
                graph.nodes.remove(n)
            graph.nodes[idx:idx] = [hs, new_mul]
            for v in (add.outputs[0], clip.outputs[0], mul.outputs[0]):
                graph.value_info.pop(v, None)
            count += 1
            changed = True
            break
    if count:
        _drop_unused_initializers(graph)
    return count


def simplify(graph: Graph) -> dict[str, int]:
    """All simplifications, in order; returns counts."""
    return {"conv_affine": fold_conv_affine(graph), "hardswish": hardswish_to_hardsigmoid(graph)}
