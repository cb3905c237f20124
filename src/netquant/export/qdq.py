"""Building an ONNX QDQ model from a QuantizedGraph.

Activation quantized at a node output:  t -> QuantizeLinear -> DequantizeLinear -> (all consumers of t)
Activation quantized at a node input:   t -> Q -> DQ -> that consumer (shared by consumers with the same params)
Weight / bias / constant operand:       integer initializer -> DequantizeLinear(axis) -> consumer
    w_q = clamp(round(w / s) + z, qmin, qmax) in the spec's storage dtype; bias int32 with s = s_in * s_w.
Ranges narrower than the storage type (int4 activations, custom quant_min/max) get a Clip on the integers.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from netquant.core.int_kernels import quantize_limited
from netquant.core.qdq_types import clip_range, qdq_min_opset
from netquant.core.spec import Granularity, QuantSpec, RoundingPolicy
from netquant.core.tensor_config import TensorQuantConfig
from netquant.errors import ExportError
from netquant.export.slots import Slot, emits, iter_slots, params_of, root
from netquant.graph.dtypes import TORCH_TO_ONNX
from netquant.passes.quant_graph import QuantizedGraph, constant_codes


@dataclass
class QdqStats:
    """What the builder inserted."""

    quantize_nodes: int = 0
    dequantize_nodes: int = 0
    integer_initializers: int = 0
    quantized_ops: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    fp32_bytes: int = 0  # serialized size of the FP32 model it was built on


def _storage(spec: QuantSpec, constant: bool) -> torch.dtype:
    """Storage dtype in the file; symmetric 9..32-bit constants are stored as int32 (zero point 0); unsigned
    9..16-bit ranges as uint16 (QuantizeLinear takes no int32 zero point; uint16 Q/DQ: opset 21)."""
    dtype = spec.storage_dtype
    if dtype == torch.int32 and not spec.is_float and spec.qmin >= 0 and spec.qmax <= 65535:
        return torch.uint16
    if constant and not spec.is_float and dtype not in (torch.int8, torch.uint8) and spec.symmetric and spec.signed:
        return torch.int32
    return dtype


def required_opset(qgraph: QuantizedGraph) -> int:
    """Lowest ai.onnx opset that can express every quantizer of `qgraph` as QDQ."""
    need = max(13, int(qgraph.platform.min_opset))
    initializers = qgraph.graph.initializers
    for slot in iter_slots(qgraph):
        if not emits(slot.config):
            continue
        spec = root(slot.config).spec
        need = max(need, qdq_min_opset(TORCH_TO_ONNX[_storage(spec, slot.tensor in initializers)], spec))
    return need


_RAW_DTYPES = {np.dtype(t) for t in ("int8", "uint8", "int16", "uint16", "int32", "int64", "float32")}


class QdqBuilder:
    """Inserts Q/DQ nodes into an ONNX copy of a QuantizedGraph's FP32 graph."""

    def __init__(self, qgraph: QuantizedGraph, model: onnx.ModelProto,
                 external: Sequence[onnx.TensorProto] = (),
                 complete: Callable[[Iterable[onnx.TensorProto]], None] | None = None) -> None:
        """external: initializers of the model that `model` does not hold yet (large weights, shared with the FP32
        base): appended at the end of build() where the exported model still reads them, after complete(those) has
        written the data of any that are headers only (only their headers are read before)."""
        self.qgraph = qgraph
        self.model = model
        self.graph = model.graph
        self.stats = QdqStats()
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.external = {t.name: t for t in external}
        self.complete = complete
        self.initializers.update(self.external)
        self.new_nodes: list[onnx.NodeProto] = []
        self.taken: set[str] = set(self.initializers)
        for n in self.graph.node:
            self.taken.update(n.output)
            self.taken.update(n.input)
            self.taken.add(n.name)
        self.taken.update(v.name for v in self.graph.input)
        self.by_name = {n.name: n for n in self.graph.node if n.name}
        self.source_names = {n.name for n in qgraph.graph.nodes}  # nodes not named here were added by an upgrade
        self.by_output = {n.output[0]: n for n in self.graph.node if n.output}
        # the nodes reading each tensor before the build: rewiring only takes readers away from a constant (new
        # nodes wait in new_nodes until _finish), so its readers at the end are among these
        self.readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
        for n in self.graph.node:
            for i in dict.fromkeys(n.input):
                self.readers[i].append(n)
        rounding = {root(s.config).spec.rounding for s in iter_slots(qgraph) if emits(s.config)
                    and s.tensor not in self.initializers}
        odd = sorted(r.name for r in rounding if r is not RoundingPolicy.ROUND_HALF_EVEN)
        if odd:
            self.stats.warnings.append(
                f"activation rounding {', '.join(odd)} is written as ONNX QuantizeLinear, which rounds half "
                "to even; ties may differ by one step from the platform's engine")

    # ------------------------------------------------------------------ helpers
    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def proto_node(self, qnode_name: str) -> onnx.NodeProto:
        node = self.by_name.get(qnode_name)
        if node is None:
            qnode = self.qgraph.graph.node(qnode_name)
            node = self.by_output.get(qnode.outputs[0]) if qnode.outputs else None
        if node is None:
            raise ExportError(f"node '{qnode_name}' of the quantized graph is missing from the exported model")
        return node

    def add_init(self, base: str, array: np.ndarray | torch.Tensor, elem_type: int | None = None) -> str:
        name = self.fresh(base)
        if isinstance(array, torch.Tensor):
            array = array.detach().cpu()
            if elem_type in (TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT8E5M2):
                raw = array.view(torch.uint8).numpy().tobytes()
                tensor = helper.make_tensor(name, elem_type, list(array.shape), raw, raw=True)
                self.graph.initializer.append(tensor)
                return name
            if hasattr(torch, "uint16") and array.dtype == torch.uint16:
                array = array.to(torch.int32).numpy().astype(np.uint16)
            else:
                array = array.numpy()
        array = np.asarray(array)  # (np.ascontiguousarray would turn a scalar into shape (1,))
        if array.dtype in _RAW_DTYPES:  # written in place: no copy of the (weight-sized) codes into the graph
            tensor = self.graph.initializer.add()
            tensor.name = name
            tensor.dims.extend(array.shape)
            tensor.data_type = helper.np_dtype_to_tensor_dtype(array.dtype)
            tensor.raw_data = array.tobytes()
            return name
        self.graph.initializer.append(numpy_helper.from_array(array if array.flags.c_contiguous else array.copy(), name))
        return name

    def scale_zp(self, base: str, scale: torch.Tensor, zp: torch.Tensor, spec: QuantSpec,
                 dtype: torch.dtype) -> tuple[str, str]:
        s = self.add_init(f"{base}_scale", scale.to(torch.float32))
        if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            z = self.add_init(f"{base}_zero_point", torch.zeros(zp.shape, dtype=dtype), TORCH_TO_ONNX[dtype])
        elif hasattr(torch, "uint16") and dtype == torch.uint16:
            z = self.add_init(f"{base}_zero_point", zp.to(torch.int32).numpy().astype(np.uint16))
        else:
            z = self.add_init(f"{base}_zero_point", zp.to(torch.int64).to(dtype))
        return s, z

    @staticmethod
    def axis_attrs(spec: QuantSpec, rank: int) -> dict[str, int]:
        if spec.granularity is Granularity.PER_TENSOR:
            return {}
        axis = spec.axis + rank if spec.axis is not None and spec.axis < 0 else spec.axis
        if spec.granularity is Granularity.PER_GROUP:
            return {"axis": int(axis), "block_size": int(spec.group_size)}
        return {"axis": int(axis)}

    # ------------------------------------------------------------------ emitters
    def activation_pair(self, src: str, cfg: TensorQuantConfig, tensor: str, out: str | None = None) -> str:
        """src -> Q -> [Clip] -> DQ -> out (fresh name unless given); returns the DQ output name.

        `tensor` is the tensor's name in the quantized graph (for its rank when the scale is per-axis).
        """
        scale, zp, spec = params_of(cfg)
        dtype = _storage(spec, constant=False)
        base = tensor.replace("/", "_")
        s, z = self.scale_zp(base, scale, zp, spec, dtype)
        attrs: dict[str, int] = {}
        if spec.granularity is not Granularity.PER_TENSOR:
            shape = self.qgraph.graph.value(tensor).shape
            if shape is None and spec.axis is not None and spec.axis < 0:
                raise ExportError(f"per-axis activation '{tensor}' has unknown rank; use a non-negative axis")
            attrs = self.axis_attrs(spec, len(shape or ()))
        q_out = self.fresh(f"{base}_QuantizeLinear_Output")
        self.new_nodes.append(helper.make_node("QuantizeLinear", [src, s, z], [q_out],
                                               name=self.fresh(f"{base}_QuantizeLinear"), **attrs))
        clip = clip_range(spec, TORCH_TO_ONNX[dtype])
        if clip is not None:
            lo = self.add_init(f"{base}_qmin", torch.tensor(clip[0]).to(dtype))
            hi = self.add_init(f"{base}_qmax", torch.tensor(clip[1]).to(dtype))
            clipped = self.fresh(f"{base}_QuantizeLinear_Clipped")
            self.new_nodes.append(helper.make_node("Clip", [q_out, lo, hi], [clipped],
                                                   name=self.fresh(f"{base}_QuantClip")))
            q_out = clipped
        dq_out = out or self.fresh(f"{base}_DequantizeLinear_Output")
        self.new_nodes.append(helper.make_node("DequantizeLinear", [q_out, s, z], [dq_out],
                                               name=self.fresh(f"{base}_DequantizeLinear"), **attrs))
        self.stats.quantize_nodes += 1
        self.stats.dequantize_nodes += 1
        return dq_out

    def constant_dq(self, name: str, cfg: TensorQuantConfig) -> str:
        """Integer initializer + DequantizeLinear for a constant tensor; returns the DQ output name."""
        scale, zp, spec = params_of(cfg)
        proto = self.initializers[name]
        weight = self.qgraph.graph.initializers.get(name)
        if isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and \
                tuple(weight.shape) == tuple(proto.dims):  # the graph's own tensor: no copy out of the proto
            x = weight
        else:
            value = numpy_helper.to_array(proto)
            if not np.issubdtype(value.dtype, np.floating):
                raise ExportError(f"constant '{name}' has dtype {value.dtype}; only float tensors can be quantized")
            x = torch.from_numpy(np.array(value, dtype=np.float32))
            weight = None
        dtype = _storage(spec, constant=True)
        if spec.granularity is Granularity.PER_CHANNEL:
            axis = spec.axis + x.dim() if spec.axis < 0 else spec.axis
            if x.dim() == 0 or scale.numel() != x.shape[axis]:
                raise ExportError(f"per-channel scale of '{name}' has {scale.numel()} values but the tensor has "
                                  f"shape {tuple(x.shape)} (axis {spec.axis})")
        if weight is not None:
            q = constant_codes(weight, cfg)  # shared with the executors and earlier exports
        else:
            q = quantize_limited(x, scale, zp, spec, cfg.effective_pair_limit)
        q = q.to(dtype) if not spec.is_float else q
        base = name.replace("/", "_")
        qname = self.add_init(f"{base}_quantized", q, TORCH_TO_ONNX[dtype])
        s, z = self.scale_zp(f"{base}_quantized", scale, zp, spec, dtype)
        out = self.fresh(f"{base}_DequantizeLinear_Output")
        self.new_nodes.append(helper.make_node("DequantizeLinear", [qname, s, z], [out],
                                               name=self.fresh(f"{base}_DequantizeLinear"),
                                               **self.axis_attrs(spec, x.dim())))
        self.stats.dequantize_nodes += 1
        self.stats.integer_initializers += 1
        return out

    # ------------------------------------------------------------------ main
    def build(self) -> onnx.ModelProto:
        producers: dict[str, Slot] = {}
        consumers: dict[str, list[Slot]] = defaultdict(list)
        quantized_ops: dict[str, None] = {}
        for slot in iter_slots(self.qgraph):
            if slot.is_input:
                consumers[slot.tensor].append(slot)
            else:
                producers[slot.tensor] = slot
            if emits(slot.config):
                quantized_ops[slot.node] = None
        self.stats.quantized_ops = list(quantized_ops)
        tensors = list(dict.fromkeys([*producers, *consumers]))
        for tensor in tensors:
            if tensor in self.initializers:
                self._constant(tensor, consumers.get(tensor, []))
            else:
                self._activation(tensor, producers.get(tensor), consumers.get(tensor, []))
        self._finish()
        return self.model

    def _producer_of(self, tensor: str, producer: Slot) -> onnx.NodeProto:
        """The node of the exported model that writes `tensor`: the producer op itself, or, where the opset
        upgrade rewrote it, the node the upgrade left writing that name (Softmax 11 -> 13 writes
        `<name>_intermediate` and a Reshape writes `<name>`; the Reshape is exact, so quantizing its output
        quantizes the same values)."""
        node = self.proto_node(producer.node)
        if tensor in node.output:
            return node
        writer = next((n for n in self.graph.node if tensor in n.output), None)
        if writer is None:
            raise ExportError(f"output '{tensor}' of node '{producer.node}' is written by no node of the exported "
                              "model (the opset upgrade rewrote this node)")
        return writer

    def _rewire(self, slot: Slot, new_name: str) -> None:
        """Point input `slot.index` of the slot's node at `new_name`. Where the opset upgrade rewrote that node
        (Softmax 11 -> 13 reads its input through Shape / Flatten nodes of its own), the nodes the upgrade added
        that read the tensor are rewired instead: they compute that op on the same values."""
        node = self.proto_node(slot.node)
        if slot.index < len(node.input) and node.input[slot.index] == slot.tensor:
            node.input[slot.index] = new_name
            return
        added = [n for n in self.graph.node if slot.tensor in n.input and n.name not in self.source_names]
        if not added:
            raise ExportError(f"input {slot.index} of node '{slot.node}' is not '{slot.tensor}' in the "
                              "exported model (the opset upgrade rewrote this node)")
        for n in added:
            for i, name in enumerate(n.input):
                if name == slot.tensor:
                    n.input[i] = new_name

    def _constant(self, tensor: str, users: list[Slot]) -> None:
        groups: list[tuple[TensorQuantConfig, str]] = []
        for slot in users:
            if not emits(slot.config):
                continue
            shared = next((name for cfg, name in groups if _same_quant(cfg, slot.config)), None)
            if shared is None:
                shared = self.constant_dq(tensor, slot.config)
                groups.append((slot.config, shared))
            self._rewire(slot, shared)
        if groups and not any(tensor in n.input for n in self.readers.get(tensor, ())) and \
                tensor not in {o.name for o in self.graph.output}:
            proto = self.initializers.pop(tensor)  # float copy no longer used
            if self.external.pop(tensor, None) is None:
                self.graph.initializer.remove(proto)

    def _activation(self, tensor: str, producer: Slot | None, users: list[Slot]) -> None:
        current: TensorQuantConfig | None = None
        if producer is not None and emits(producer.config):
            node = self._producer_of(tensor, producer)
            fp_name = self.fresh(f"{tensor}_fp32")
            for i, out in enumerate(node.output):
                if out == tensor:
                    node.output[i] = fp_name
            self.activation_pair(fp_name, producer.config, tensor, out=tensor)
            current = producer.config
        groups: list[tuple[TensorQuantConfig, str]] = []
        for slot in users:
            if not emits(slot.config):
                continue
            if current is not None and _same_quant(current, slot.config):
                continue  # the tensor is already quantized with these params
            shared = next((name for cfg, name in groups if _same_quant(cfg, slot.config)), None)
            if shared is None:
                shared = self.activation_pair(tensor, slot.config, tensor)
                groups.append((slot.config, shared))
            self._rewire(slot, shared)

    def _finish(self) -> None:
        nodes = list(self.graph.node) + self.new_nodes
        del self.graph.node[:]
        self.graph.node.extend(toposort(nodes, self.graph))
        if self.complete is not None:
            self.complete(self.external.values())
        self.graph.initializer.extend(self.external.values())  # the large float initializers still read
        self.external = {}


def _same_quant(a: TensorQuantConfig, b: TensorQuantConfig) -> bool:
    """Same quantizer: one dominates the other, or equal spec and params."""
    ra, rb = root(a), root(b)
    if ra is rb:
        return True
    if ra.spec != rb.spec or ra.params is None or rb.params is None:
        return False
    return bool(torch.equal(ra.params.scale.float().cpu(), rb.params.scale.float().cpu())
                and torch.equal(ra.params.zero_point.cpu(), rb.params.zero_point.cpu()))


def _subgraph_inputs(node: onnx.NodeProto) -> set[str]:
    """Names a node's subgraphs read from the enclosing scope (implicit inputs)."""
    names: set[str] = set()
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            local = {i.name for i in g.input} | {t.name for t in g.initializer}
            for n in g.node:
                local.update(n.output)
            for n in g.node:
                names.update(i for i in n.input if i and i not in local)
                names.update(_subgraph_inputs(n) - local)
    return names


def toposort(nodes: list[onnx.NodeProto], graph: onnx.GraphProto) -> list[onnx.NodeProto]:
    """Nodes in dependency order, otherwise keeping the given order (iterative DFS)."""
    producer: dict[str, int] = {}
    for i, n in enumerate(nodes):
        for o in n.output:
            if o:
                producer[o] = i
    deps = [[producer[x] for x in [*n.input, *_subgraph_inputs(n)] if x in producer] for n in nodes]
    state = [0] * len(nodes)  # 0 new, 1 open, 2 done
    order: list[int] = []
    for start in range(len(nodes)):
        if state[start]:
            continue
        stack = [(start, 0)]
        state[start] = 1
        while stack:
            i, k = stack[-1]
            if k < len(deps[i]):
                stack[-1] = (i, k + 1)
                j = deps[i][k]
                if state[j] == 0:
                    state[j] = 1
                    stack.append((j, 0))
                elif state[j] == 1:
                    raise ExportError(f"cycle through node '{nodes[j].name}' in the exported graph '{graph.name}'")
            else:
                state[i] = 2
                order.append(i)
                stack.pop()
    return [nodes[i] for i in order]
