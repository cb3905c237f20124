"""Attention and transformer-block ops in int8 on onnxruntime: rewrites of a QDQ model that analysis.attention times.

The onnxruntime platform quantizes MatMuls with a weight only; these rewrites put the rest of a transformer block in
int8 where measurement says so (analysis.attention decides, per kind of op):

- SCORES (Q·Kᵀ) and CONTEXT (A·V): MatMuls of two activations. STATIC: x -> Q(s, z) -> DQ on both inputs (uint8
  affine, s = (max(hi, 0) - min(lo, 0)) / 255 from calibrated ranges; onnxruntime runs DQ -> MatMul as
  MatMulIntegerToFloat / QLinearMatMul). DYNAMIC: DynamicQuantizeLinear on both inputs, MatMulInteger, Cast,
  Mul(s_a * s_b): scales from each run's own min / max (per tensor).
- SOFTMAX, LAYERNORM, GELU: STATIC puts Q -> DQ on the op's input and output (onnxruntime: DQ -> Softmax -> Q is
  QLinearSoftmax; LayerNormalization and GELU have no int8 kernel, so the measurement is what keeps them float).
- PER_TOKEN for the dynamic weight MatMuls export.dynamic wrote (DynamicQuantizeLinear -> MatMulInteger -> Cast ->
  Mul): the activation gets one symmetric int8 scale per row (token) instead of one per tensor:
  s_t = max |x_t| / 127, q_t = round(x_t / s_t) (int8, |q| <= 127), y = float(q · W_q) * s_t * s_w.

Node names keep the rewritten node's name as a prefix so profiles map them back. Ranges are {tensor: (lo, hi)}.
"""

from __future__ import annotations

import enum
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


class AttnKind(enum.Enum):
    SCORES = "scores"  # Q·Kᵀ: activation x activation MatMul feeding a Softmax
    CONTEXT = "context"  # A·V: activation x activation MatMul reading a Softmax
    SOFTMAX = "softmax"
    LAYERNORM = "layernorm"
    GELU = "gelu"


class AttnMode(enum.Enum):
    FLOAT = "float"
    STATIC = "static"
    DYNAMIC = "dynamic"  # MatMuls only: run-time per-tensor scales


_PASS_FORWARD = {"Div", "Mul", "Add", "Sub", "Where", "Cast"}  # scores -> (scale, mask) -> Softmax
_PASS_BACK = {"Cast", "Where", "Dropout", "Identity"}  # Softmax -> (mask fill, dropout) -> context


def _constants(graph: onnx.GraphProto) -> set[str]:
    """Names of initializers, Constant outputs and outputs of DequantizeLinear of an initializer (weights)."""
    out = {t.name for t in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" or (n.op_type == "DequantizeLinear" and n.input[0] in out):
            out.update(n.output)
    return out


def _maps(graph: onnx.GraphProto) -> tuple[dict[str, onnx.NodeProto], dict[str, list[onnx.NodeProto]]]:
    producer = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            consumers[i].append(n)
    return producer, consumers


def _reaches_softmax(node: onnx.NodeProto, consumers: Mapping[str, list[onnx.NodeProto]], hops: int = 4) -> bool:
    cur = node
    for _ in range(hops):
        nxt = consumers.get(cur.output[0], [])
        if len(nxt) != 1:
            return False
        cur = nxt[0]
        if cur.op_type == "Softmax":
            return True
        if cur.op_type not in _PASS_FORWARD:
            return False
    return False


def _softmax_behind(name: str, producer: Mapping[str, onnx.NodeProto], hops: int = 3) -> onnx.NodeProto | None:
    """The Softmax whose output `name` is, possibly through Cast / Dropout / Identity and a Where's value inputs (the
    fill of fully masked rows); None where it is none."""
    p = producer.get(name)
    if p is None or hops < 0:
        return None
    if p.op_type == "Softmax":
        return p
    if p.op_type not in _PASS_BACK:
        return None
    values = p.input[1:3] if p.op_type == "Where" else p.input[:1]
    return next((s for s in (_softmax_behind(v, producer, hops - 1) for v in values) if s is not None), None)


def find_attention_ops(model: onnx.ModelProto) -> dict[str, AttnKind]:
    """Node name -> kind of every SCORES / CONTEXT MatMul, Softmax, LayerNormalization and GELU (a Gelu node, or the
    Erf of the decomposed x * 0.5 * (1 + erf(x / sqrt 2))) of the graph. Unnamed nodes are skipped. A Softmax counts
    where it feeds a CONTEXT MatMul (attention probabilities): a classifier's final Softmax is no attention op (in
    int8 its probabilities would have 1/256 steps, for no measurable time)."""
    graph = model.graph
    consts = _constants(graph)
    producer, consumers = _maps(graph)
    out: dict[str, AttnKind] = {}
    attention_softmax: set[str] = set()
    for n in graph.node:
        if n.op_type != "MatMul" or any(i in consts for i in n.input) or _reaches_softmax(n, consumers):
            continue
        softmax = _softmax_behind(n.input[0], producer)
        if softmax is not None:
            attention_softmax.add(softmax.name)
    for n in graph.node:
        if not n.name:
            continue
        if n.op_type == "MatMul" and not any(i in consts for i in n.input):
            if _reaches_softmax(n, consumers):
                out[n.name] = AttnKind.SCORES
            elif _softmax_behind(n.input[0], producer) is not None:
                out[n.name] = AttnKind.CONTEXT
        elif n.op_type == "Softmax" and n.name in attention_softmax:
            out[n.name] = AttnKind.SOFTMAX
        elif n.op_type == "LayerNormalization":
            out[n.name] = AttnKind.LAYERNORM
        elif n.op_type in ("Gelu", "Erf") and _gelu_io(n, producer, consumers) is not None:
            out[n.name] = AttnKind.GELU
    return out


def _gelu_io(n: onnx.NodeProto, producer: Mapping[str, onnx.NodeProto],
             consumers: Mapping[str, list[onnx.NodeProto]]) -> tuple[str, str] | None:
    """(input x, output y) of a GELU: a Gelu node, or Div(x, sqrt 2) -> Erf -> Add(1) -> Mul(x) -> Mul(0.5) (or with
    the 0.5 first); None for an Erf that is not one."""
    if n.op_type == "Gelu":
        return n.input[0], n.output[0]
    div = producer.get(n.input[0])
    if div is None or div.op_type != "Div":
        return None
    x, cur = div.input[0], n
    for _ in range(3):
        nxt = consumers.get(cur.output[0], [])
        if len(nxt) != 1 or nxt[0].op_type not in ("Add", "Mul"):
            break
        cur = nxt[0]
    return (x, cur.output[0]) if cur is not n and cur.op_type == "Mul" else None


def tensors_to_range(model: onnx.ModelProto, kinds: Mapping[str, AttnKind]) -> list[str]:
    """The float tensors whose calibrated ranges a STATIC rewrite of `kinds` needs (sorted, unique)."""
    graph = model.graph
    producer, consumers = _maps(graph)
    by_name = {n.name: n for n in graph.node}
    names: set[str] = set()
    for name, kind in kinds.items():
        n = by_name.get(name)
        if n is None:
            continue
        if kind in (AttnKind.SCORES, AttnKind.CONTEXT):
            names.update(n.input[:2])
        elif kind is AttnKind.GELU:
            io = _gelu_io(n, producer, consumers)
            if io is not None:
                names.update(io)
        else:
            names.update((n.input[0], n.output[0]))
    return sorted(names)


def uint8_params(lo: float, hi: float) -> tuple[np.ndarray, np.ndarray]:
    """(scale, zero point) of a static Q/DQ pair over [min(lo, 0), max(hi, 0)]: scale = (hi - lo) / 255 (at least
    1e-8 / 255), zero point round(-lo / scale) in 0..255."""
    lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
    scale = max(hi - lo, 1e-8) / 255.0
    zp = int(np.clip(round(-lo / scale), 0, 255))
    return np.array(scale, np.float32), np.array(zp, np.uint8)


class _Rewriter:
    def __init__(self, model: onnx.ModelProto, ranges: Mapping[str, tuple[float, float]]) -> None:
        self.model = model
        self.graph = model.graph
        self.ranges = ranges
        self.producer, self.consumers = _maps(self.graph)
        self.before: dict[str, list[onnx.NodeProto]] = defaultdict(list)  # node name -> nodes to insert before it
        self.after: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        self.qdq: dict[str, str] = {}  # tensor -> its Q/DQ copy
        self.inits: list[onnx.TensorProto] = []
        self.replaced: dict[str, list[onnx.NodeProto]] = {}

    def _quantized(self, tensor: str) -> bool:
        p = self.producer.get(tensor)
        return p is not None and p.op_type == "DequantizeLinear"

    def qdq_of(self, tensor: str, anchor: onnx.NodeProto, after: bool = False) -> str | None:
        """The DQ(Q(tensor)) copy of `tensor` (made once), its nodes placed before `anchor` (after it when `after`);
        None when the tensor has no range or is already dequantized."""
        if tensor in self.qdq:
            return self.qdq[tensor]
        if self._quantized(tensor) or tensor not in self.ranges:
            return None
        scale, zp = uint8_params(*self.ranges[tensor])
        base = f"{tensor}/attn_qdq"
        self.inits += [numpy_helper.from_array(scale, f"{base}/scale"), numpy_helper.from_array(zp, f"{base}/zp")]
        nodes = [helper.make_node("QuantizeLinear", [tensor, f"{base}/scale", f"{base}/zp"], [f"{base}/q"],
                                  name=f"{anchor.name}/attn_Q/{tensor}"),
                 helper.make_node("DequantizeLinear", [f"{base}/q", f"{base}/scale", f"{base}/zp"], [f"{base}/dq"],
                                  name=f"{anchor.name}/attn_DQ/{tensor}")]
        (self.after if after else self.before)[anchor.name].extend(nodes)
        self.qdq[tensor] = f"{base}/dq"
        return self.qdq[tensor]

    def static_inputs(self, node: onnx.NodeProto, count: int) -> bool:
        done = False
        for k in range(count):
            new = self.qdq_of(node.input[k], node)
            if new is not None:
                node.input[k] = new
                done = True
        return done

    def static_output(self, node: onnx.NodeProto, tensor: str) -> bool:
        """Q -> DQ after `tensor` (an output of `node` or of the GELU chain it starts): its readers read the DQ."""
        readers = list(self.consumers.get(tensor, []))
        anchor = self.producer.get(tensor, node)
        new = self.qdq_of(tensor, anchor, after=True)
        if new is None:
            return False
        for r in readers:
            for k, i in enumerate(r.input):
                if i == tensor:
                    r.input[k] = new
        if any(o.name == tensor for o in self.graph.output):  # keep the graph output name: a copy reads the DQ
            self.after[anchor.name].append(helper.make_node("Identity", [new], [f"{tensor}/attn_out"],
                                                            name=f"{anchor.name}/attn_out"))
        return True

    def dynamic_matmul(self, node: onnx.NodeProto) -> bool:
        if any(self._quantized(i) for i in node.input[:2]):
            return False
        p = node.name
        a, b = node.input[0], node.input[1]
        nodes = [
            helper.make_node("DynamicQuantizeLinear", [a], [f"{p}/dyn_a_q", f"{p}/dyn_a_s", f"{p}/dyn_a_z"],
                             name=f"{p}/DynamicQuantizeLinear_a"),
            helper.make_node("DynamicQuantizeLinear", [b], [f"{p}/dyn_b_q", f"{p}/dyn_b_s", f"{p}/dyn_b_z"],
                             name=f"{p}/DynamicQuantizeLinear_b"),
            helper.make_node("MatMulInteger", [f"{p}/dyn_a_q", f"{p}/dyn_b_q", f"{p}/dyn_a_z", f"{p}/dyn_b_z"],
                             [f"{p}/dyn_int32"], name=p),
            helper.make_node("Cast", [f"{p}/dyn_int32"], [f"{p}/dyn_float"], name=f"{p}/Cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", [f"{p}/dyn_a_s", f"{p}/dyn_b_s"], [f"{p}/dyn_scale"], name=f"{p}/scale"),
            helper.make_node("Mul", [f"{p}/dyn_float", f"{p}/dyn_scale"], [node.output[0]], name=f"{p}/Mul"),
        ]
        self.replaced[node.name] = nodes
        return True

    def finish(self) -> None:
        out: list[onnx.NodeProto] = []
        for n in self.graph.node:
            out.extend(self.before.get(n.name, []))
            out.extend(self.replaced.get(n.name, [n]))
            out.extend(self.after.get(n.name, []))
        del self.graph.node[:]
        self.graph.node.extend(_toposort(out, self.graph))
        self.graph.initializer.extend(self.inits)


def _toposort(nodes: list[onnx.NodeProto], graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes in an order where every input is produced before it is read (stable: the given order where it is)."""
    ready = {i.name for i in graph.input} | {t.name for t in graph.initializer} | {""}
    produced = {o for n in nodes for o in n.output}
    ready |= {i for n in nodes for i in n.input if i not in produced}  # outer-scope / missing names
    left, out = list(nodes), []
    while left:
        rest = []
        for n in left:
            if all(i in ready for i in n.input):
                out.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(left):  # a cycle cannot happen here; keep what is left as it was
            out.extend(rest)
            break
        left = rest
    return out


def apply_attention(model: onnx.ModelProto, modes: Mapping[str, AttnMode],
                    ranges: Mapping[str, tuple[float, float]]) -> list[str]:
    """Rewrite each node named in `modes` (find_attention_ops' names) to its mode, in place (module docstring);
    returns the names rewritten (a STATIC tensor without a range, or one already dequantized, is left alone)."""
    kinds = find_attention_ops(model)
    rw = _Rewriter(model, ranges)
    done = []
    for n in list(model.graph.node):
        mode = modes.get(n.name)
        kind = kinds.get(n.name)
        if mode is None or mode is AttnMode.FLOAT or kind is None:
            continue
        if kind in (AttnKind.SCORES, AttnKind.CONTEXT):
            ok = rw.static_inputs(n, 2) if mode is AttnMode.STATIC else rw.dynamic_matmul(n)
        elif mode is not AttnMode.STATIC:
            ok = False
        elif kind is AttnKind.GELU:
            io = _gelu_io(n, rw.producer, rw.consumers)
            assert io is not None
            x_reader = rw.producer[n.input[0]] if n.op_type == "Erf" else n  # the Div (or Gelu) reading x
            ok = False
            new = rw.qdq_of(io[0], x_reader)
            if new is not None:
                for r in rw.consumers.get(io[0], []):
                    if r is x_reader or (n.op_type == "Erf" and r.op_type == "Mul" and _in_chain(r, n, rw)):
                        r.input[:] = [new if i == io[0] else i for i in r.input]
                ok = True
            ok = rw.static_output(n, io[1]) or ok
        else:
            ok = rw.static_inputs(n, 1)
            ok = rw.static_output(n, n.output[0]) or ok
        if ok:
            done.append(n.name)
    rw.finish()
    return done


def _in_chain(mul: onnx.NodeProto, erf: onnx.NodeProto, rw: _Rewriter) -> bool:
    """Whether `mul` is one of the Add / Mul nodes after `erf` in its GELU chain."""
    cur = erf
    for _ in range(3):
        nxt = rw.consumers.get(cur.output[0], [])
        if len(nxt) != 1:
            return False
        cur = nxt[0]
        if cur is mul:
            return True
    return False


def per_token_dynamic(model: onnx.ModelProto) -> list[str]:
    """Rewrite every dynamic weight MatMul of export.dynamic (DynamicQuantizeLinear(x) -> MatMulInteger(x_q, W_q,
    x_z[, w_z]) with int8 W_q and an all-zero or absent w_z -> Cast -> Mul(scale)) to per-token int8 activation
    scales (module docstring), in place; returns the MatMulInteger names rewritten."""
    graph = model.graph
    producer, consumers = _maps(graph)
    types = {t.name: t.data_type for t in graph.initializer}
    zero_inits = {t.name for t in graph.initializer if not numpy_helper.to_array(t).any()}
    replaced: dict[str, list[onnx.NodeProto]] = {}
    drop: set[int] = set()
    done = []
    for mm in graph.node:
        if mm.op_type != "MatMulInteger" or types.get(mm.input[1]) != TensorProto.INT8:
            continue
        if len(mm.input) > 3 and mm.input[3] and mm.input[3] not in zero_inits:
            continue
        dq = producer.get(mm.input[0])
        cast = consumers.get(mm.output[0], [])
        if dq is None or dq.op_type != "DynamicQuantizeLinear" or len(cast) != 1 or cast[0].op_type != "Cast":
            continue
        muls = consumers.get(cast[0].output[0], [])
        if len(muls) != 1 or muls[0].op_type != "Mul":
            continue
        scale_mul = producer.get(muls[0].input[1]) or producer.get(muls[0].input[0])
        if scale_mul is None or scale_mul.op_type != "Mul" or dq.output[1] not in scale_mul.input:
            continue
        w_scale = next(i for i in scale_mul.input if i != dq.output[1])
        p, x = mm.name, dq.input[0]
        c127 = f"{p}/tok_127"
        graph.initializer.extend([numpy_helper.from_array(np.array(127.0, np.float32), c127),
                                  numpy_helper.from_array(np.array(1e-30, np.float32), f"{p}/tok_eps")])
        replaced[mm.name] = [
            helper.make_node("Abs", [x], [f"{p}/tok_abs"], name=f"{p}/tok_Abs"),
            helper.make_node("ReduceMax", [f"{p}/tok_abs"], [f"{p}/tok_amax"], name=f"{p}/tok_ReduceMax", axes=[-1],
                             keepdims=1),
            helper.make_node("Max", [f"{p}/tok_amax", f"{p}/tok_eps"], [f"{p}/tok_amax1"], name=f"{p}/tok_Max"),
            helper.make_node("Div", [f"{p}/tok_amax1", c127], [f"{p}/tok_s"], name=f"{p}/tok_scale"),
            helper.make_node("Div", [x, f"{p}/tok_s"], [f"{p}/tok_xs"], name=f"{p}/tok_Div"),
            helper.make_node("Round", [f"{p}/tok_xs"], [f"{p}/tok_r"], name=f"{p}/tok_Round"),
            helper.make_node("Cast", [f"{p}/tok_r"], [f"{p}/tok_q"], name=f"{p}/tok_Cast", to=TensorProto.INT8),
            helper.make_node("MatMulInteger", [f"{p}/tok_q", mm.input[1]], [mm.output[0]], name=p),
            cast[0],
            helper.make_node("Mul", [cast[0].output[0], f"{p}/tok_s"], [f"{p}/tok_rows"], name=f"{p}/tok_Mul"),
            helper.make_node("Mul", [f"{p}/tok_rows", w_scale], [muls[0].output[0]], name=f"{p}/Mul"),
        ]
        drop.update({id(dq), id(cast[0]), id(muls[0])})
        if len(consumers.get(scale_mul.output[0], [])) == 1:
            drop.add(id(scale_mul))
        done.append(mm.name)
    if not done:
        return done
    out: list[onnx.NodeProto] = []
    for n in graph.node:
        if n.op_type == "MatMulInteger" and n.name in replaced:
            out.extend(replaced[n.name])
        elif id(n) not in drop:
            out.append(n)
    del graph.node[:]
    graph.node.extend(_toposort(out, graph))
    return done


@dataclass(frozen=True)
class AttentionRewrite:
    """What export applies after the dynamic rewrite (QuantizedGraph.attention_rewrite; hashable: it is part of the
    build state): per-token dynamic activations, then node -> mode with the ranges STATIC needs."""

    modes: tuple[tuple[str, AttnMode], ...] = ()
    per_token: bool = False
    ranges: tuple[tuple[str, float, float], ...] = ()

    def apply(self, model: onnx.ModelProto) -> bool:
        """Rewrite `model` in place; whether anything changed."""
        done = bool(self.per_token and per_token_dynamic(model))
        if self.modes:
            done = bool(apply_attention(model, dict(self.modes), {t: (lo, hi) for t, lo, hi in self.ranges})) or done
        return done
