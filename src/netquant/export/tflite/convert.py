"""Converter: a QuantizedGraph -> one TFLite subgraph, op by op, mirroring netquant's Q/DQ semantics.

Every graph tensor lives in the file as int8 (when its producer's config quantizes it) or float32, channels-last
when it is a 4-D activation of a conv net (layout.py). An op whose activation inputs and outputs all carry
active configs becomes an int8 TFLite op with netquant's scales; any other op runs in float, with QUANTIZE /
DEQUANTIZE where netquant quantizes a tensor it reads or writes (TFLite runs mixed graphs). Shapes are static:
one batch of the validation data (batch 1) runs through the executor first, fixing every shape and folding
shape arithmetic (Shape -> Slice -> Concat -> Reshape) to constants.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from netquant.core.spec import QuantSpec
from netquant.core.tensor_config import TensorQuantConfig
from netquant.errors import ExportError
from netquant.export.slots import params_of
from netquant.export.tflite import layout
from netquant.export.tflite.writer import FlatbufferWriter, Quant, Tensor
from netquant.graph import Executor, Node
from netquant.passes.quant_graph import QuantizedGraph

SPATIAL_OPS = frozenset({"Conv", "MaxPool", "AveragePool", "GlobalAveragePool", "GlobalMaxPool"})


@dataclass
class Stored:
    """A graph tensor as the file holds it."""

    tensor: Tensor
    cl: bool  # 4-D, stored channels-last

    @property
    def is_int8(self) -> bool:
        return self.tensor.dtype == np.int8


@dataclass
class Recorded:
    """Shapes of every tensor and values of the static ones, from one run at the export's fixed input shape."""

    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    static: dict[str, np.ndarray] = field(default_factory=dict)


def record(qgraph: QuantizedGraph, feeds: Mapping[str, np.ndarray]) -> Recorded:
    """Run `feeds` through the FP32 graph: every tensor's shape; values of tensors computed from constants and
    shapes only (Shape and what follows from it)."""
    graph = qgraph.graph
    rec = Recorded()
    static = set(graph.initializers)
    for name, t in graph.initializers.items():
        rec.shapes[name] = tuple(t.shape)
        rec.static[name] = t.detach().cpu().numpy()
    for name, v in feeds.items():
        rec.shapes[name] = tuple(v.shape)

    def post(node: Node, outputs: list[Any]) -> None:
        is_static = node.op_type in ("Shape", "Size", "Constant") or all(
            not i or i in static for i in node.inputs)
        for name, y in zip(node.outputs, outputs):
            if not name or not isinstance(y, torch.Tensor):
                continue
            rec.shapes[name] = tuple(y.shape)
            if is_static:
                static.add(name)
                rec.static[name] = y.detach().cpu().numpy().copy()

    ex = Executor(graph, fold_constants=False, inplace=False)
    ex.add_post_hook(post)
    with torch.no_grad():
        ex.run({k: torch.from_numpy(np.ascontiguousarray(v).reshape(np.shape(v))) for k, v in feeds.items()})
    return rec


def quant_of(cfg: TensorQuantConfig, what: str) -> Quant:
    """TFLite int8 params of an activation config (per-tensor, 8-bit signed); ExportError otherwise."""
    scale, zp, spec = params_of(cfg)
    _check_int8(spec, what, per_tensor=True)
    return Quant.of(scale, zp)


def _check_int8(spec: QuantSpec, what: str, per_tensor: bool) -> None:
    from netquant.core.spec import Granularity

    if spec.is_float or spec.bits != 8 or not spec.signed or (
            per_tensor and spec.granularity is not Granularity.PER_TENSOR):
        raise ExportError(f"TFLite export: {what} is quantized as {spec.describe()}; TFLite's int8 kernels need "
                          "int8 per-tensor activations and int8 symmetric weights (quantize with platform "
                          "'tflite_int8')")


OpConverter = Callable[["Converter", Node], None]


class Converter:
    """State of one conversion; ops.py holds the per-op converters, dispatched by op type."""

    def __init__(self, qgraph: QuantizedGraph, rec: Recorded, converters: Mapping[str, OpConverter]) -> None:
        self.qg = qgraph
        self.graph = qgraph.graph
        self.rec = rec
        self.w = FlatbufferWriter()
        self.values: dict[str, Stored] = {}
        self.cache: dict[tuple[Any, ...], Stored] = {}
        self.converters = converters
        self.skip: set[str] = set()  # nodes folded into another op (fused activations, hard-swish)
        self.alias: dict[str, str] = {}  # graph tensor -> the tensor holding its value (fused-away ops)
        self.hard_swish: dict[str, int] = {}  # Mul node -> index of x in Mul(x, HardSigmoid(x))
        self.float_ops: list[str] = []  # "op_type 'name'" of ops run in float
        self.consumers: dict[str, list[Node]] = {}
        for n in self.graph.nodes:
            for i in n.inputs:
                if i:
                    self.consumers.setdefault(i, []).append(n)

    # ------------------------------------------------------------------ configs
    def in_cfg(self, node: Node, i: int) -> TensorQuantConfig | None:
        oc = self.qg.op_configs.get(node.name)
        cfg = oc.inputs[i] if oc is not None and i < len(oc.inputs) else None
        return cfg if cfg is not None and cfg.is_active else None

    def out_cfg(self, node: Node, j: int = 0) -> TensorQuantConfig | None:
        oc = self.qg.op_configs.get(node.name)
        cfg = oc.outputs[j] if oc is not None and j < len(oc.outputs) else None
        return cfg if cfg is not None and cfg.is_active else None

    def in_quant(self, node: Node, i: int) -> Quant | None:
        cfg = self.in_cfg(node, i)
        return quant_of(cfg, f"input {i} of {node.op_type} '{node.name}'") if cfg is not None else None

    def out_quant(self, node: Node, j: int = 0) -> Quant | None:
        cfg = self.out_cfg(node, j)
        return quant_of(cfg, f"output {j} of {node.op_type} '{node.name}'") if cfg is not None else None

    def is_const(self, name: str) -> bool:
        return name in self.rec.static

    def const(self, name: str) -> np.ndarray:
        return self.rec.static[name]

    def shape(self, name: str) -> tuple[int, ...]:
        name = self.alias.get(name, name)
        if name not in self.rec.shapes:
            raise ExportError(f"TFLite export: no static shape for tensor '{name}'")
        return self.rec.shapes[name]

    def activation_inputs(self, node: Node) -> list[int]:
        """Inputs that are float activations (not constants, not omitted)."""
        return [i for i, n in enumerate(node.inputs) if n and not self.is_const(n)
                and np.issubdtype(self._dtype_of(n), np.floating)]

    def _dtype_of(self, name: str) -> Any:
        v = self.values.get(self.alias.get(name, name))
        if v is not None:
            return np.float32 if v.is_int8 else v.tensor.dtype
        return np.float32

    def int8_mode(self, node: Node, inputs: list[int] | None = None) -> bool:
        """True when netquant quantizes every activation input (`inputs`, default all) and every output."""
        idx = self.activation_inputs(node) if inputs is None else inputs
        outs = [j for j, o in enumerate(node.outputs) if o]
        return bool(idx) and all(self.in_cfg(node, i) is not None for i in idx) and \
            all(self.out_cfg(node, j) is not None for j in outs)

    # ------------------------------------------------------------------ tensors
    def new(self, name: str, onnx_shape: tuple[int, ...], cl: bool, quant: Quant | None,
            dtype: Any = None) -> Stored:
        """A fresh non-constant tensor for graph tensor `name` (int8 when `quant`)."""
        dt = np.int8 if quant is not None else (dtype or np.float32)
        t = self.w.add_tensor(name, layout.stored_shape(onnx_shape, cl), dt, quant)
        return Stored(t, cl and len(onnx_shape) == 4)

    def define(self, name: str, value: Stored) -> None:
        self.values[name] = value

    def output(self, node: Node, onnx_shape: tuple[int, ...] | None = None, cl: bool = False, j: int = 0,
               int8: bool = True) -> Stored:
        """The tensor for node output j: int8 with its config's params when int8 (and the config is active)."""
        name = node.outputs[j]
        shape = onnx_shape if onnx_shape is not None else self.shape(name)
        q = self.out_quant(node, j) if int8 else None
        value = self.new(name, shape, cl and len(shape) == 4, q)
        self.define(name, value)
        return value

    def constant(self, name: str, data: np.ndarray, quant: Quant | None = None) -> Tensor:
        return self.w.add_const(name, data, quant)

    def get(self, name: str, *, cl: bool | None = None, quant: Quant | None = None,
            as_float: bool = False) -> Stored:
        """Graph tensor `name` stored as asked: channels-last or not (None: as it is), int8 with `quant`
        (QUANTIZE from float, requantizing QUANTIZE from other int8 params), or float (DEQUANTIZE)."""
        name = self.alias.get(name, name)
        if self.is_const(name):
            return self._const_value(name, cl, quant)
        if name not in self.values:
            raise ExportError(f"TFLite export: tensor '{name}' is used before it is produced")
        v = self.values[name]
        key_layout = v.cl if cl is None or len(self.shape(name)) != 4 else cl
        key = (name, key_layout, quant, as_float and quant is None)
        if key in self.cache:
            return self.cache[key]
        cur = v
        if quant is not None and (not cur.is_int8 or cur.tensor.quant != quant):
            t = self.w.add_tensor(f"{name}_q", cur.tensor.shape, np.int8, quant)
            self.w.add_op("QUANTIZE", [cur.tensor], [t])
            cur = Stored(t, cur.cl)
        elif quant is None and as_float and cur.is_int8:
            t = self.w.add_tensor(f"{name}_dq", cur.tensor.shape, np.float32)
            self.w.add_op("DEQUANTIZE", [cur.tensor], [t])
            cur = Stored(t, cur.cl)
        if key_layout != cur.cl:
            perm = layout.TO_NHWC if key_layout else layout.TO_NCHW
            shape = tuple(cur.tensor.shape[p] for p in perm)
            t = self.w.add_tensor(f"{name}_{'nhwc' if key_layout else 'nchw'}", shape, cur.tensor.dtype,
                                  cur.tensor.quant)
            self.w.add_op("TRANSPOSE", [cur.tensor, self.w.add_const(f"{name}_perm", np.array(perm, np.int32))],
                          [t])
            cur = Stored(t, key_layout)
        self.cache[key] = cur
        return cur

    def _const_value(self, name: str, cl: bool | None, quant: Quant | None) -> Stored:
        data = np.asarray(self.const(name))
        use_cl = bool(cl) and data.ndim == 4
        key = ("const", name, use_cl, quant)
        if key in self.cache:
            return self.cache[key]
        x = layout.to_stored(data, use_cl)
        if quant is not None:
            q = np.clip(np.round(x.astype(np.float64) / quant.scale[0]) + quant.zero_point[0], -128, 127)
            t = self.constant(f"{name}_q", q.astype(np.int8), quant)
        else:
            if np.issubdtype(x.dtype, np.floating):
                x = x.astype(np.float32)
            elif x.dtype == np.int64:
                x = x.astype(np.int32)
            t = self.constant(name, x)
        value = Stored(t, use_cl)
        self.cache[key] = value
        return value

    def input_for(self, node: Node, i: int, *, cl: bool | None = None, int8: bool) -> Stored:
        """Input i as an int8 op reads it (int8 with the input config's params) or as a float op reads it
        (float; fake-quantized through the input config's params when it has one, as netquant runs it)."""
        q = self.in_quant(node, i)
        if int8:
            if q is None:
                raise ExportError(f"TFLite export: input {i} of {node.op_type} '{node.name}' has no quantizer")
            return self.get(node.inputs[i], cl=cl, quant=q)
        if q is not None:
            v = self.get(node.inputs[i], cl=cl, quant=q)
            return self._dequantized(node.inputs[i], v)
        return self.get(node.inputs[i], cl=cl, as_float=True)

    def _dequantized(self, name: str, v: Stored) -> Stored:
        if not v.is_int8:
            return v
        key = ("dq", v.tensor.index)
        if key not in self.cache:
            t = self.w.add_tensor(f"{name}_dq", v.tensor.shape, np.float32)
            self.w.add_op("DEQUANTIZE", [v.tensor], [t])
            self.cache[key] = Stored(t, v.cl)
        return self.cache[key]

    def finish_float(self, node: Node, value: Stored, j: int = 0) -> None:
        """A float op's output: QUANTIZE it when netquant quantizes that output, then define it."""
        q = self.out_quant(node, j)
        if q is not None:
            t = self.w.add_tensor(f"{node.outputs[j]}_q", value.tensor.shape, np.int8, q)
            self.w.add_op("QUANTIZE", [value.tensor], [t])
            value = Stored(t, value.cl)
        self.define(node.outputs[j], value)

    def float_output(self, node: Node, cl: bool = False, j: int = 0,
                     onnx_shape: tuple[int, ...] | None = None) -> Stored:
        """A float tensor for node output j (finish_float quantizes it afterwards when needed)."""
        shape = onnx_shape if onnx_shape is not None else self.shape(node.outputs[j])
        return self.new(f"{node.outputs[j]}_f" if self.out_cfg(node, j) is not None else node.outputs[j],
                        shape, cl and len(shape) == 4, None)

    def note_float(self, node: Node) -> None:
        self.float_ops.append(f"{node.op_type} '{node.name}'")

    # ------------------------------------------------------------------ main
    def convert(self, input_names: list[str], input_shapes: dict[str, tuple[int, ...]]) -> None:
        for name in input_names:
            shape = input_shapes[name]
            v = self.new(name, shape, len(shape) == 4, None)
            self.define(name, v)
            self.w.inputs.append(v.tensor.index)
        for node in self.graph.nodes:
            if node.name in self.skip:
                continue
            if all(not o or self.is_const(o) for o in node.outputs):
                continue  # shape arithmetic and constant folding: recorded values
            fn = self.converters.get(node.op_type)
            if fn is None or node.domain not in ("", "ai.onnx"):
                raise ExportError(f"TFLite export: no TFLite conversion for {node.op_type} node '{node.name}' "
                                  f"(domain '{node.domain or 'ai.onnx'}'); supported: "
                                  f"{', '.join(sorted(self.converters))}")
            fn(self, node)
        for v in self.graph.outputs:
            self._model_output(v.name)

    def _model_output(self, name: str) -> None:
        src = self.alias.get(name, name)
        if self.is_const(src):
            raise ExportError(f"TFLite export: model output '{name}' is a constant")
        v = self.values[src]
        if v.is_int8:
            cur = self.get(src, cl=False) if v.cl else v
            if cur.tensor.name == name:
                self.w.rename(cur.tensor, f"{name}_int8")
            t = self.w.add_tensor(name, layout.stored_shape(self.shape(src), False), np.float32)
            self.w.add_op("DEQUANTIZE", [cur.tensor], [t])
        else:
            cur = self.get(src, cl=False, as_float=True)
            t = cur.tensor
        self.w.outputs.append(t.index)
