"""Graph clean-ups and rewrites.  Each returns how many nodes it changed and keeps the graph valid
(topologically sorted, every value defined), so `save_onnx` passes onnx.checker after any of them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import torch

from netquant.errors import ModelError, NetquantError
from netquant.graph.ir import Graph, Node
from netquant.graph.pattern import match_chains

NONDETERMINISTIC = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike", "Multinomial",
                    "Bernoulli"}
_CONTROL = {"If", "Loop", "Scan"}


def _readers(graph: Graph, value: str) -> list[Node]:
    return graph.consumers(value)


def _drop_unread_initializers(graph: Graph, names: set[str]) -> None:
    """Drop the initializers among `names` that no node (or subgraph) reads and no graph output is."""
    names = {n for n in names if n in graph.initializers and not graph.is_graph_output(n)}
    if not names:
        return
    read = set()
    for node in graph.nodes:  # one pass over the graph, not one per name
        read.update(node.inputs)
        for sub in node.subgraphs():
            read.update(sub.free_values())
    for name in names - read:
        del graph.initializers[name]
        graph.initializer_types.pop(name, None)


# ---------------------------------------------------------------------------- Constant -> initializer
def constant_value(node: Node) -> torch.Tensor | np.ndarray | None:
    """Value of a Constant node (any of its value* attributes), None for sparse values."""
    a = node.attrs
    if "value" in a:
        return a["value"]
    if "value_float" in a:
        return torch.tensor(a["value_float"], dtype=torch.float32)
    if "value_floats" in a:
        return torch.tensor(a["value_floats"], dtype=torch.float32)
    if "value_int" in a:
        return torch.tensor(a["value_int"], dtype=torch.int64)
    if "value_ints" in a:
        return torch.tensor(a["value_ints"], dtype=torch.int64)
    if "value_string" in a:
        return np.array(a["value_string"], dtype=object)
    if "value_strings" in a:
        return np.array(a["value_strings"], dtype=object)
    return None


def constants_to_initializers(graph: Graph) -> int:
    """Constant nodes become initializers of their graph (subgraphs too); returns the count."""
    count = 0
    for g in list(graph.iter_graphs()):
        for node in list(g.nodes):
            if node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
                continue
            out = node.outputs[0]
            value = constant_value(node)
            if value is None or g.is_graph_output(out):
                continue
            if isinstance(value, np.ndarray):
                g.opaque_initializers[out] = onnx.numpy_helper.from_array(value, out).SerializeToString()
            else:
                g.initializers[out] = value
            g.nodes.remove(node)
            count += 1
    return count


# ---------------------------------------------------------------------------- Identity / Dropout
def _is_passthrough(graph: Graph, node: Node) -> bool:
    if node.domain not in ("", "ai.onnx"):
        return False
    if node.op_type == "Identity":
        return len(node.inputs) == 1 and bool(node.inputs[0])
    if node.op_type == "Dropout":
        if len(node.outputs) > 1 and node.outputs[1] and (graph.consumers(node.outputs[1])
                                                          or graph.is_graph_output(node.outputs[1])):
            return False  # the mask is used
        if len(node.inputs) > 2 and node.inputs[2]:
            mode = graph.initializers.get(node.inputs[2])
            if mode is None or bool(mode.reshape(-1)[0]):
                return False  # training mode on, or decided at run time
        return True
    return False


def remove_identity(graph: Graph) -> int:
    """Remove Identity and inference-mode Dropout nodes (subgraphs too); returns the count."""
    count = 0
    for g in list(graph.iter_graphs()):
        for node in list(g.nodes):
            if not _is_passthrough(g, node):
                continue
            node.inputs = node.inputs[:1]
            node.outputs = node.outputs[:1]
            try:
                g.remove_node(node, reconnect=True)
            except Exception:  # input and output both pinned (graph input -> graph output): keep it
                if node not in g.nodes:
                    g.nodes.append(node)
                    g.toposort()
                continue
            count += 1
    return count


# ---------------------------------------------------------------------------- constant folding
def fold_constants(graph: Graph, keep: Callable[[Graph, Node], bool] | None = None) -> int:
    """Evaluate nodes whose inputs are all initializers (deterministic ops, not producing graph
    outputs); their outputs become initializers.  keep(graph, node): True leaves that node as it is (a caller's
    rule, e.g. an embedding table's Gather of constant positions, which passes.embeddings stores in int8 while its
    folded rows would stay float).  Returns the number of folded nodes."""
    # importing netquant.graph.ops (the package of .registry) registers every op
    from netquant.graph.ops.registry import OpContext, lookup_op

    constants_to_initializers(graph)
    count = 0
    consumed: set[str] = set()
    for node in list(graph.nodes):
        if (node.op_type in NONDETERMINISTIC or node.op_type in _CONTROL or list(node.subgraphs())
                or any(graph.is_graph_output(o) for o in node.outputs)
                or not all((not i) or i in graph.initializers for i in node.inputs)
                or (keep is not None and keep(graph, node))):
            continue
        if node.op_type == "Dropout" and len(node.outputs) > 1:
            continue
        domain = "" if node.domain in ("", "ai.onnx") else node.domain
        opset = graph.opset_imports.get(domain, 1)
        try:
            fn = lookup_op(node.op_type, domain, opset, node.name)
        except Exception:
            continue  # unknown op: leave it for the runtime
        ctx = OpContext(op_type=node.op_type, name=node.name, domain=domain, opset=opset,
                        num_outputs=len(node.outputs))
        args = [graph.initializers[i] if i else None for i in node.inputs]
        try:
            with torch.inference_mode():
                outs = fn(args, node.attrs, ctx)
        except NetquantError:
            raise
        except Exception as exc:  # an op on constant inputs fails: the model is invalid, whatever the data
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            raise ModelError(f"graph '{graph.name}': node '{node.name}' ({node.op_type}) fails on its constant inputs "
                             f"({', '.join(i for i in node.inputs if i)}): {first}; the model is invalid (onnxruntime fails "
                             "on it too): fix or re-export it") from exc
        if not all(isinstance(o, torch.Tensor) for o in outs):
            continue
        for name, out in zip(node.outputs, outs):
            if name:
                graph.initializers[name] = out.detach().clone()
        consumed.update(i for i in node.inputs if i)
        graph.nodes.remove(node)
        count += 1
    _drop_unread_initializers(graph, consumed)
    return count


# ---------------------------------------------------------------------------- BatchNorm folding
def _bn_scale_shift(graph: Graph, bn: Node) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(s, t) with BN(y) = y * s + t per channel, in float64; None if BN params are not constant."""
    names = bn.inputs[1:5]
    if len(names) != 4 or not all(n in graph.initializers for n in names):
        return None
    if bn.attrs.get("spatial", 1) != 1 or bn.attrs.get("training_mode", 0):
        return None
    if any(o for o in bn.outputs[1:]):
        return None
    gamma, beta, mean, var = (graph.initializers[n].to(torch.float64).reshape(-1) for n in names)
    eps = float(bn.attrs.get("epsilon", 1e-5))
    s = gamma / torch.sqrt(var + eps)
    return s, beta - mean * s


def _set_initializer(graph: Graph, owner: Node, slot: int, value: torch.Tensor, base: str) -> None:
    """Write value as input `slot` of `owner`, in place when nobody else reads that initializer."""
    name = owner.inputs[slot] if slot < len(owner.inputs) else ""
    shared = bool(name) and any(n is not owner for n in graph.consumers(name))
    if not name or shared or graph.is_graph_output(name):
        name = graph.fresh_name(base)
        while len(owner.inputs) <= slot:
            owner.inputs.append("")
        owner.inputs[slot] = name
    graph.initializers[name] = value
    graph.initializer_types.pop(name, None)


def _absorb_bn(graph: Graph, producer: Node, bn: Node) -> None:
    """producer now writes BN's output name; BN and its unread params disappear."""
    params = set(bn.inputs) - {producer.outputs[0], ""}
    graph.nodes.remove(bn)
    graph.value_info.pop(producer.outputs[0], None)
    graph.declared_value_info.discard(producer.outputs[0])
    producer.outputs[0] = bn.outputs[0]
    _drop_unread_initializers(graph, params)


def _fold_into_conv(graph: Graph, conv: Node, bn: Node) -> bool:
    ss = _bn_scale_shift(graph, bn)
    if ss is None or conv.inputs[1] not in graph.initializers:
        return False
    if len(conv.inputs) > 2 and conv.inputs[2] and conv.inputs[2] not in graph.initializers:
        return False
    s, t = ss
    w = graph.initializers[conv.inputs[1]]
    if not w.is_floating_point():
        return False
    w64 = w.to(torch.float64)
    if conv.op_type == "Conv":
        out_ch = w.shape[0]
        w_new = w64 * s.reshape(-1, *([1] * (w.dim() - 1)))
    else:  # ConvTranspose: weight [C_in, M/g, k...]
        g = int(conv.attrs.get("group", 1))
        out_ch = w.shape[1] * g
        wv = w64.reshape(g, w.shape[0] // g, w.shape[1], *w.shape[2:])
        wv = wv * s.reshape(g, 1, w.shape[1], *([1] * (w.dim() - 2)))
        w_new = wv.reshape(w.shape)
    if s.numel() != out_ch:
        return False
    has_b = len(conv.inputs) > 2 and bool(conv.inputs[2])
    b = graph.initializers[conv.inputs[2]].to(torch.float64).reshape(-1) if has_b else torch.zeros_like(s)
    _set_initializer(graph, conv, 1, w_new.to(w.dtype), f"{conv.name}_W_bnfolded")
    _set_initializer(graph, conv, 2, (b * s + t).to(w.dtype), f"{conv.name}_B_bnfolded")
    _absorb_bn(graph, conv, bn)
    return True


def _fold_into_gemm(graph: Graph, gemm: Node, bn: Node) -> bool:
    ss = _bn_scale_shift(graph, bn)
    if ss is None or gemm.inputs[1] not in graph.initializers:
        return False
    has_c = len(gemm.inputs) > 2 and bool(gemm.inputs[2])
    if has_c and gemm.inputs[2] not in graph.initializers:
        return False
    s, t = ss
    b = graph.initializers[gemm.inputs[1]]
    if b.dim() != 2 or not b.is_floating_point():
        return False
    trans_b = int(gemm.attrs.get("transB", 0))
    n_out = b.shape[0] if trans_b else b.shape[1]
    if s.numel() != n_out:
        return False
    b64 = b.to(torch.float64)
    b_new = b64 * (s.reshape(-1, 1) if trans_b else s.reshape(1, -1))
    beta = float(gemm.attrs.get("beta", 1.0))
    if has_c:
        c = graph.initializers[gemm.inputs[2]].to(torch.float64) * beta
        if c.dim() == 2 and c.shape[0] != 1:
            c_new = c * s.reshape(1, -1) + t.reshape(1, -1)
        else:
            c_new = c.reshape(-1).expand(n_out) * s + t
    else:
        c_new = t
    _set_initializer(graph, gemm, 1, b_new.to(b.dtype), f"{gemm.name}_B_bnfolded")
    _set_initializer(graph, gemm, 2, c_new.to(b.dtype).contiguous(), f"{gemm.name}_C_bnfolded")
    gemm.attrs["beta"] = 1.0
    gemm.attr_types["beta"] = onnx.AttributeProto.FLOAT
    _absorb_bn(graph, gemm, bn)
    return True


def fold_batchnorm(graph: Graph) -> int:
    """Fold BatchNormalization (inference form, constant params) into a preceding Conv,
    ConvTranspose or Gemm with constant weights:  W' = W * s, b' = (b - mean) * s + beta,
    s = gamma / sqrt(var + eps).  Constant nodes become initializers first.  Returns the count."""
    constants_to_initializers(graph)
    count = 0
    for producer, bn in match_chains(graph, ["Conv|ConvTranspose|Gemm", "BatchNormalization"]):
        if producer.domain not in ("", "ai.onnx") or bn.inputs[0] != producer.outputs[0]:
            continue
        if producer.op_type == "Gemm":
            done = _fold_into_gemm(graph, producer, bn)
        else:
            done = _fold_into_conv(graph, producer, bn)
        count += int(done)
    return count


# ---------------------------------------------------------------------------- Conv -> Mul / Add constants
def _per_channel(value: torch.Tensor, channels: int, rank: int) -> torch.Tensor | None:
    """value as a [channels] vector if it broadcasts over a [N, C, ...] tensor of `rank` per channel."""
    if value.numel() == 1:
        return value.reshape(1).expand(channels).to(torch.float64)
    if value.dim() > rank:
        return None
    shape = [1] * (rank - value.dim()) + list(value.shape)
    if any(d != 1 for i, d in enumerate(shape) if i != 1) or shape[1] != channels:
        return None
    return value.reshape(channels).to(torch.float64)


def fold_conv_affine(graph: Graph) -> int:
    """Fold per-channel constant Mul / Add that directly follow a Conv into its weight and bias:
    Conv(x, W, b) * s = Conv(x, W * s, b * s);  Conv(x, W, b) + d = Conv(x, W, b + d).
    (Paddle exports BatchNorm-like affines this way.)  Returns the number of folded nodes."""
    constants_to_initializers(graph)
    count = 0
    changed = True
    while changed:
        changed = False
        for conv, op in match_chains(graph, ["Conv", "Mul|Add"]):
            if conv.domain not in ("", "ai.onnx") or op.domain not in ("", "ai.onnx"):
                continue
            if len(conv.inputs) < 2 or conv.inputs[1] not in graph.initializers:
                continue
            has_b = len(conv.inputs) > 2 and bool(conv.inputs[2])
            if has_b and conv.inputs[2] not in graph.initializers:
                continue
            other = [i for i in op.inputs if i != conv.outputs[0]]
            if len(other) != 1 or len(op.inputs) != 2 or other[0] not in graph.initializers:
                continue
            w = graph.initializers[conv.inputs[1]]
            const = graph.initializers[other[0]]
            if not w.is_floating_point() or const.dtype != w.dtype:
                continue
            vec = _per_channel(const, w.shape[0], w.dim())
            if vec is None:
                continue
            b = graph.initializers[conv.inputs[2]].to(torch.float64) if has_b else torch.zeros(
                w.shape[0], dtype=torch.float64)
            if op.op_type == "Mul":
                w_new = w.to(torch.float64) * vec.reshape(-1, *([1] * (w.dim() - 1)))
                _set_initializer(graph, conv, 1, w_new.to(w.dtype), f"{conv.name}_W_scaled")
                b_new = b * vec
            else:
                b_new = b + vec
            _set_initializer(graph, conv, 2, b_new.to(w.dtype), f"{conv.name}_B_folded")
            _absorb_bn(graph, conv, op)  # conv takes over op's output name; op's constant dropped if unread
            count += 1
            changed = True
    return count


def cleanup(graph: Graph) -> dict[str, Any]:
    """constants_to_initializers, remove_identity, fold_constants, then drop dead nodes."""
    report = {"constants": constants_to_initializers(graph), "identity": remove_identity(graph),
              "folded": fold_constants(graph)}
    before = len(graph.nodes)
    graph.remove_unused()
    report["dead"] = before - len(graph.nodes)
    return report
