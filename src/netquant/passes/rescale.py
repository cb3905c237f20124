"""Exact per-channel rescaling of an FP32 graph, shared by the repair passes (SmoothQuant, equalization).

A linear op y = op(x, W) with input channels c and output channels o:

    op(x / s, W * s_in) = op(x, W)           (W's input channel c multiplied by s[c])
    op(x, W * f_out) + b * f = f * (op(x, W) + b)   (output channel o multiplied by f[o])

and a positively homogeneous op g (Relu, LeakyRelu, PRelu, MaxPool, Identity) commutes with a positive
per-channel factor: g(f * x) = f * g(x) for f > 0; so do Min / Max with a constant c once c is scaled too:
min(f * x, f * c) = f * min(x, c) (the per-channel clip that exact equalization makes of a ReLU6). `fold_channel_scale` multiplies a tensor's channels by f
by rewriting upstream constants (a producer's weights and bias, the bias Add after a MatMul, a
LayerNormalization's scale and bias); `insert_channel_mul` puts an explicit Mul where nothing folds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from netquant.core.ops import fake_quantize
from netquant.core.qparams import choose_qparams
from netquant.core.spec import Granularity, QuantSpec
from netquant.graph import Graph, Node

HOMOGENEOUS = ("Relu", "LeakyRelu", "PRelu", "MaxPool", "Identity")  # g(f x) = f g(x) for f > 0, per channel
LINEAR_OPS = ("Conv", "Gemm", "MatMul")


@dataclass(frozen=True)
class LinearOp:
    """A Conv / Gemm / MatMul whose weight is a float initializer, with how its weight maps channels.

    in_axis / out_axis: the weight dims of input and output channels (Conv: the grouped layout, see in_view);
    act_axis: the channel axis of its input and output activations (1 for Conv, -1 for Gemm / MatMul);
    bias_index: the op's bias input (Conv input 2, Gemm input 2) if it has one."""

    node: Node
    act_axis: int
    bias_index: int | None
    groups: int = 1

    @property
    def op_type(self) -> str:
        return self.node.op_type

    @property
    def weight(self) -> str:
        """The weight initializer's name (read from the node: rescaling may give it a fresh one)."""
        return self.node.inputs[1]


def linear_op(graph: Graph, node: Node) -> LinearOp | None:
    """The LinearOp of `node` when its weight is a float constant in a supported layout, else None."""
    if node.op_type not in LINEAR_OPS or len(node.inputs) < 2 or node.domain not in ("", "ai.onnx"):
        return None
    w = graph.initializers.get(node.inputs[1])
    if w is None or not w.is_floating_point():
        return None
    if node.op_type == "Conv":
        if w.dim() < 3:
            return None
        bias = 2 if len(node.inputs) > 2 and node.inputs[2] else None
        return LinearOp(node, 1, bias, int(node.attrs.get("group", 1)))
    if w.dim() != 2:
        return None
    if node.op_type == "Gemm":
        if node.attrs.get("transA", 0):
            return None
        bias = 2 if len(node.inputs) > 2 and node.inputs[2] else None
        return LinearOp(node, -1, bias)
    return LinearOp(node, -1, None)


def _trans_b(op: LinearOp) -> bool:
    return op.op_type == "Gemm" and bool(op.node.attrs.get("transB", 0))


def in_view(op: LinearOp, w: torch.Tensor) -> torch.Tensor:
    """W as [groups, out per group, in per group, rest] (Conv) or [1, N, K, 1] (Gemm / MatMul): input channel
    c = g * in_per_group + j sits at [g, :, j, :]."""
    if op.op_type == "Conv":
        g = op.groups
        return w.reshape(g, w.shape[0] // g, w.shape[1], -1)
    m = w if _trans_b(op) else w.t()  # [N, K]
    return m.reshape(1, m.shape[0], m.shape[1], 1)


def _from_in_view(op: LinearOp, v: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if op.op_type == "Conv":
        return v.reshape(shape)
    m = v.reshape(v.shape[1], v.shape[2])
    return (m if _trans_b(op) else m.t()).contiguous()


def in_channel_absmax(op: LinearOp, w: torch.Tensor) -> torch.Tensor:
    """max |W| over everything that reads input channel c, per c (float64)."""
    return in_view(op, w.double()).abs().amax(dim=(1, 3)).reshape(-1)


def out_channel_absmax(op: LinearOp, w: torch.Tensor) -> torch.Tensor:
    """max |W| over each output channel's weights (float64)."""
    w = w.double()
    if op.op_type == "Conv" or _trans_b(op):
        return w.reshape(w.shape[0], -1).abs().amax(1)
    return w.abs().amax(0)


def scale_in_channels(op: LinearOp, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W with input channel c multiplied by s[c] (computed in float64, returned in W's dtype)."""
    v = in_view(op, w.double())
    v = v * s.double().reshape(v.shape[0], 1, v.shape[2], 1)
    return _from_in_view(op, v, w.shape).to(w.dtype)


def scale_out_channels(op: LinearOp, w: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """W with output channel o multiplied by f[o]."""
    f = f.double()
    if op.op_type == "Conv" or _trans_b(op):
        out = w.double() * f.reshape(-1, *([1] * (w.dim() - 1)))
    else:
        out = w.double() * f.reshape(1, -1)
    return out.to(w.dtype)


def set_input(graph: Graph, node: Node, index: int, value: torch.Tensor) -> None:
    """Make input `index` of `node` the constant `value`: in place when only `node` reads that initializer, else a
    fresh initializer (the other readers keep the old value)."""
    name = node.inputs[index]
    readers = graph.consumers(name)
    if any(n is not node for n in readers) or graph.is_graph_output(name) or name in graph.input_names:
        new = graph.fresh_name(f"{name}_rescaled")
        node.inputs[index] = new
        name = new
    graph.initializers[name] = value
    graph.initializer_types.pop(name, None)


def _channel_const(value: torch.Tensor, f: torch.Tensor, act_axis: int, rank: int | None) -> torch.Tensor | None:
    """A constant broadcast against a tensor of rank `rank` (channels on act_axis: -1 the last), multiplied per
    channel by f (broadcasting gives it the channel dim if it had none); None when its shape does not allow that."""
    c = f.numel()
    if act_axis < 0:
        shape_c = [c]
    elif rank is None:
        return None
    else:
        shape_c = [c] + [1] * (rank - act_axis - 1)
    if rank is not None and value.dim() > rank:
        return None
    if value.dim() >= len(shape_c) and value.shape[value.dim() - len(shape_c)] not in (1, c):
        return None
    return (value.double() * f.double().reshape(shape_c)).to(value.dtype).contiguous()


Edit = Callable[[], None]


class Rescaler:
    """Plans and applies per-channel rescaling of tensors in one graph (module docstring)."""

    def __init__(self, graph: Graph) -> None:
        self.graph = graph

    def _single_reader(self, tensor: str) -> bool:
        return len(self.graph.consumers(tensor)) == 1 and not self.graph.is_graph_output(tensor)

    def rank(self, tensor: str) -> int | None:
        try:
            shape = self.graph.value(tensor).shape
        except Exception:  # noqa: BLE001 - an unknown value has no known rank
            return None
        return len(shape) if shape is not None else None

    def plan_fold(self, tensor: str, f: torch.Tensor, act_axis: int, rank: int | None) -> list[Edit] | None:
        """Edits that multiply channel c of `tensor` by f[c] (f > 0) by rewriting its producers' constants; None
        when no producer chain allows it. The caller makes sure every reader of `tensor` wants the scaled value."""
        g = self.graph
        node = g.producer(tensor)
        if node is None:
            return None
        op = node.op_type
        if node.domain not in ("", "ai.onnx"):
            return None
        if op in HOMOGENEOUS:
            src = node.inputs[0]
            if op == "MaxPool" and len(node.outputs) > 1 and node.outputs[1]:
                return None
            if not self._single_reader(src):
                return None
            return self.plan_fold(src, f, act_axis, rank)
        lin = linear_op(g, node)
        if lin is not None:
            if (lin.act_axis < 0) != (act_axis < 0) or (lin.act_axis >= 0 and act_axis != lin.act_axis):
                return None
            if lin.op_type == "Conv" and rank is not None and rank != g.initializers[lin.weight].dim():
                return None
            w = g.initializers[lin.weight]
            if out_channel_absmax(lin, w).numel() != f.numel():
                return None
            edits: list[Edit] = [lambda: set_input(g, node, 1, scale_out_channels(lin, g.initializers[lin.weight], f))]
            if lin.bias_index is not None:
                b = g.initializers.get(node.inputs[lin.bias_index])
                if b is None:
                    return None
                nb = _channel_const(b, f, -1, None) if b.dim() else (b.double() * f.double()).to(b.dtype)
                if nb is None:
                    return None
                edits.append(lambda: set_input(g, node, lin.bias_index, nb))  # type: ignore[arg-type]
            return edits
        if op == "LayerNormalization" and act_axis < 0:
            axis = int(node.attrs.get("axis", -1))
            if axis != -1 and (rank is None or axis != rank - 1):
                return None
            edits = []
            for i in (1, 2):
                if i >= len(node.inputs) or not node.inputs[i]:
                    continue
                v = g.initializers.get(node.inputs[i])
                if v is None or v.dim() != 1 or v.numel() != f.numel():
                    return None
                scaled = (v.double() * f.double()).to(v.dtype)
                edits.append(lambda i=i, scaled=scaled: set_input(g, node, i, scaled))
            if not edits or len(node.outputs) > 1 and any(node.outputs[1:]):
                return None
            return edits
        if op in ("Min", "Max", "Add", "Sub") and len(node.inputs) == 2:
            # min(f x, f c) = f min(x, c) for f > 0; (f x) + (f c) = f (x + c), but for a bias Add right after a
            # linear op only: the quantizer reads it as that op's bias; any other constant operand is quantized as
            # a tensor of its own (per tensor), where a per-channel spread of scales would cost the small channels
            # their precision
            consts = [i for i, name in enumerate(node.inputs) if name in g.initializers]
            if len(consts) != 1:
                return None
            ci = consts[0]
            src = node.inputs[1 - ci]
            if op in ("Add", "Sub"):
                src_node = g.producer(src)
                if src_node is None or linear_op(g, src_node) is None:
                    return None
            if not self._single_reader(src):
                return None
            nc = _channel_const(g.initializers[node.inputs[ci]], f, act_axis, rank)
            if nc is None:
                return None
            rest = self.plan_fold(src, f, act_axis, rank)
            return None if rest is None else [lambda: set_input(g, node, ci, nc), *rest]
        return None

    def insert_channel_mul(self, tensor: str, f: torch.Tensor, act_axis: int, rank: int | None,
                           readers: list[Node], name: str) -> str | None:
        """An explicit Mul(tensor, f per channel) read by `readers` instead of `tensor`; its output name (None when
        the channel axis cannot be placed)."""
        g = self.graph
        if act_axis < 0:
            const = f.float().reshape(-1)
        elif rank is None:
            return None
        else:
            const = f.float().reshape([-1] + [1] * (rank - act_axis - 1))
        cname = g.fresh_name(f"{name}_scale")
        out = g.fresh_name(f"{name}_out")
        g.initializers[cname] = const.contiguous()
        node = Node(name=g.fresh_name(name), op_type="Mul", inputs=[tensor, cname], outputs=[out])
        g.insert_node_on_edge(node, tensor, consumers=list(readers))
        src = g.value_info.get(tensor)
        if src is not None:
            g.value_info[out] = src.copy(out)
        return out


def fake_quant_activation(x: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """x through a per-tensor quantizer of `spec` whose range is x's min / max."""
    lo, hi = x.min().reshape(()), x.max().reshape(())
    p = choose_qparams(lo.float(), hi.float(), spec.with_(granularity=Granularity.PER_TENSOR, axis=None,
                                                          group_size=None) if spec.granularity
                       is not Granularity.PER_TENSOR else spec)
    return fake_quantize(x.float(), p.scale, p.zero_point, spec if spec.granularity is Granularity.PER_TENSOR
                         else spec.with_(granularity=Granularity.PER_TENSOR, axis=None, group_size=None))


def fake_quant_weight(op: LinearOp, w: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """W through `spec`'s quantizer with min / max params: per output channel when the spec is per channel (or per
    group), else per tensor."""
    if spec.granularity is Granularity.PER_TENSOR:
        p = choose_qparams(w.min().float(), w.max().float(), spec)
        return fake_quantize(w.float(), p.scale, p.zero_point, spec)
    axis = 0 if op.op_type == "Conv" or _trans_b(op) else 1
    moved = w.float().movedim(axis, 0).reshape(w.shape[axis], -1)
    ch = spec.with_(granularity=Granularity.PER_CHANNEL, axis=0, group_size=None)
    p = choose_qparams(moved.amin(1), moved.amax(1), ch)
    fq = fake_quantize(moved, p.scale, p.zero_point, ch)
    return fq.reshape(w.movedim(axis, 0).shape).movedim(0, axis)
