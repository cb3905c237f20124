"""Graph IR: values (tensor edges), nodes (ops) and graphs, with the structural edits every pass needs.

Invariant kept by every edit here: `Graph.nodes` is in topological order; value names are unique;
node names are unique within a graph.
"""

from __future__ import annotations

import copy as _copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from netquant.errors import ModelError


@dataclass
class Value:
    """A tensor edge: name, shape (int = static, str = symbolic, None = unknown dim) and dtype."""

    name: str
    shape: tuple[int | str | None, ...] | None = None
    dtype: torch.dtype | None = None
    # ONNX element type (TensorProto.DataType); kept so dtypes torch lacks (int4, string) survive a save.
    elem_type: int | None = None
    # Non-tensor types (sequence, optional, map) are kept as the serialized onnx.TypeProto.
    type_proto: bytes | None = None
    doc_string: str = ""

    def copy(self, name: str | None = None) -> Value:
        v = _copy.copy(self)
        if name is not None:
            v.name = name
        return v


@dataclass(eq=False)
class Node:
    """One op. `inputs` / `outputs` are value names ('' marks an omitted optional input). Nodes compare (and hash)
    by identity: list.remove / `in` on a graph's nodes find that very node, in O(1) per comparison."""

    name: str
    op_type: str
    domain: str = ""
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    attrs: dict[str, Any] = field(default_factory=dict)
    # AttributeProto.AttributeType per attribute, so empty lists / ints-vs-floats round-trip exactly.
    attr_types: dict[str, int] = field(default_factory=dict)
    doc_string: str = ""
    # ONNX >= 1.16 node fields, kept opaque for the round trip (serialized protobuf messages).
    extra: dict[str, Any] = field(default_factory=dict)

    def subgraphs(self) -> Iterator[Graph]:
        """Graph-valued attributes (If branches, Loop / Scan bodies)."""
        for value in self.attrs.values():
            if isinstance(value, Graph):
                yield value
            elif isinstance(value, list):
                yield from (v for v in value if isinstance(v, Graph))

    def __repr__(self) -> str:
        return f"Node({self.name!r}, {self.op_type}, in={self.inputs}, out={self.outputs})"


@dataclass
class ModelInfo:
    """Model-level fields kept for a lossless save (not used by the executor)."""

    ir_version: int = 10
    producer_name: str = ""
    producer_version: str = ""
    domain: str = ""
    model_version: int = 0
    doc_string: str = ""
    metadata_props: dict[str, str] = field(default_factory=dict)
    # serialized FunctionProto / TrainingInfoProto messages, passed through untouched
    functions: list[bytes] = field(default_factory=list)
    training_info: list[bytes] = field(default_factory=list)
    # the external-data files the model was read with (absolute paths; empty when read from bytes or a proto)
    data_files: list[str] = field(default_factory=list)


class Graph:
    """An ONNX graph as python objects; initializers are torch tensors."""

    def __init__(self, name: str = "graph", nodes: list[Node] | None = None,
                 inputs: list[Value] | None = None, outputs: list[Value] | None = None,
                 initializers: dict[str, torch.Tensor] | None = None,
                 value_info: dict[str, Value] | None = None, opset: int | None = None,
                 opset_imports: dict[str, int] | None = None) -> None:
        self.name = name
        self.nodes: list[Node] = nodes if nodes is not None else []
        self.inputs: list[Value] = inputs if inputs is not None else []
        self.outputs: list[Value] = outputs if outputs is not None else []
        self.initializers: dict[str, torch.Tensor] = initializers if initializers is not None else {}
        self.value_info: dict[str, Value] = value_info if value_info is not None else {}
        self.opset_imports: dict[str, int] = dict(opset_imports or {})
        if opset is not None:
            self.opset_imports[""] = opset
        self.opset_imports.setdefault("", 21)
        self.doc_string = ""
        # ONNX element types of initializers whose torch dtype is a stand-in (int4 -> int8, ...)
        self.initializer_types: dict[str, int] = {}
        # initializers torch cannot hold (string tensors), kept as serialized TensorProto
        self.opaque_initializers: dict[str, bytes] = {}
        self.sparse_initializers: list[bytes] = []
        # graph inputs that name an initializer (a default the caller may override), in file order
        self.initializer_inputs: list[Value] = []
        # names whose value_info entry was declared in the file (written back on save)
        self.declared_value_info: set[str] = set()
        self.model_info = ModelInfo()
        self._outer: Graph | None = None  # enclosing graph of a subgraph

    # ---------------------------------------------------------------- basic queries
    @property
    def opset(self) -> int:
        """ai.onnx opset version."""
        return self.opset_imports.get("", 21)

    @opset.setter
    def opset(self, version: int) -> None:
        self.opset_imports[""] = int(version)

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [v.name for v in self.outputs]

    def producer(self, value: str) -> Node | None:
        """The node writing `value`, or None (graph input, initializer or outer-scope value)."""
        for node in self.nodes:
            if value in node.outputs:
                return node
        return None

    def consumers(self, value: str) -> list[Node]:
        """Nodes reading `value`, including nodes whose subgraphs read it from the outer scope."""
        found = []
        for node in self.nodes:
            if value in node.inputs or any(value in g.free_values() for g in node.subgraphs()):
                found.append(node)
        return found

    def node(self, name: str) -> Node:
        for node in self.nodes:
            if node.name == name:
                return node
        raise ModelError(f"graph '{self.name}' has no node named '{name}'")

    def value(self, name: str) -> Value:
        """Known type info of a value (graph input/output, value_info or initializer)."""
        for v in (*self.inputs, *self.outputs):
            if v.name == name:
                return v
        if name in self.value_info:
            return self.value_info[name]
        if name in self.initializers:
            t = self.initializers[name]
            return Value(name, tuple(t.shape), t.dtype)
        return Value(name)

    def is_graph_output(self, value: str) -> bool:
        return any(v.name == value for v in self.outputs)

    def value_names(self) -> set[str]:
        """Every value name defined in this graph (inputs, initializers, node outputs)."""
        names = set(self.input_names) | set(self.initializers) | set(self.opaque_initializers)
        for node in self.nodes:
            names.update(o for o in node.outputs if o)
        return names

    def free_values(self) -> set[str]:
        """Names read by this graph (or its subgraphs) but defined outside it (outer scope)."""
        defined = self.value_names()
        used: set[str] = set()
        for node in self.nodes:
            used.update(i for i in node.inputs if i)
            for sub in node.subgraphs():
                used.update(sub.free_values())
        used.update(self.output_names)
        return used - defined

    def fresh_name(self, base: str, taken: set[str] | None = None) -> str:
        """A value/node name not used in this graph: base, base_1, base_2, ..."""
        taken = taken if taken is not None else self.value_names() | {n.name for n in self.nodes}
        if base not in taken:
            return base
        i = 1
        while f"{base}_{i}" in taken:
            i += 1
        return f"{base}_{i}"

    def iter_graphs(self) -> Iterator[Graph]:
        """This graph and all nested subgraphs."""
        yield self
        for node in self.nodes:
            for sub in node.subgraphs():
                yield from sub.iter_graphs()

    # ---------------------------------------------------------------- edits
    def rename_value(self, old: str, new: str) -> None:
        """Rename a value everywhere it appears (nodes, subgraph references, io, initializers)."""
        for node in self.nodes:
            node.inputs = [new if i == old else i for i in node.inputs]
            node.outputs = [new if o == old else o for o in node.outputs]
            for sub in node.subgraphs():
                if old in sub.free_values():
                    sub._rename_free(old, new)
        for v in (*self.inputs, *self.outputs, *self.initializer_inputs):
            if v.name == old:
                v.name = new
        for table in (self.initializers, self.value_info, self.opaque_initializers, self.initializer_types):
            if old in table:
                table[new] = table.pop(old)
        if old in self.value_info:
            self.value_info[new].name = new
        if old in self.declared_value_info:
            self.declared_value_info.discard(old)
            self.declared_value_info.add(new)
        if new in self.value_info:
            self.value_info[new].name = new

    def _rename_free(self, old: str, new: str) -> None:
        for node in self.nodes:
            node.inputs = [new if i == old else i for i in node.inputs]
            for sub in node.subgraphs():
                if old in sub.free_values():
                    sub._rename_free(old, new)
        for v in self.outputs:
            if v.name == old:
                v.name = new

    def replace_uses(self, old: str, new: str, consumers: Iterable[Node] | None = None) -> None:
        """Make consumers (default: all) of value `old` read `new` instead (graph outputs untouched)."""
        targets = list(consumers) if consumers is not None else self.nodes
        for node in targets:
            node.inputs = [new if i == old else i for i in node.inputs]
            for sub in node.subgraphs():
                if old in sub.free_values():
                    sub._rename_free(old, new)

    def add_node(self, node: Node, index: int | None = None) -> Node:
        """Insert `node` (at `index`, default: as early as its inputs allow) and keep topological order."""
        if any(n.name == node.name for n in self.nodes) or not node.name:
            node.name = self.fresh_name(node.name or node.op_type)
        if index is None:
            deps = set(node.inputs) | {v for g in node.subgraphs() for v in g.free_values()}
            index = 0
            for i, n in enumerate(self.nodes):
                if deps.intersection(n.outputs):
                    index = i + 1
        self.nodes.insert(index, node)
        if not self._is_sorted():
            self.toposort()
        return node

    def insert_node_on_edge(self, node: Node, edge: str, consumers: list[Node] | None = None,
                            rewire_graph_output: bool = False) -> None:
        """Put `node` on edge `edge`: node reads `edge`, and `consumers` (default: all consumers of
        `edge`) read node.outputs[0] instead.  With rewire_graph_output, a graph output named `edge`
        is taken over by the node: the upstream value is renamed and node.outputs[0] becomes `edge`.
        """
        if edge not in node.inputs:
            raise ModelError(f"insert_node_on_edge: node '{node.name}' ({node.op_type}) does not read "
                             f"edge '{edge}'; list '{edge}' among its inputs")
        if not node.outputs:
            raise ModelError(f"insert_node_on_edge: node '{node.name}' has no output")
        if edge not in self.value_names() and edge not in self.free_values():
            raise ModelError(f"insert_node_on_edge: graph '{self.name}' has no value named '{edge}'")
        targets = self.consumers(edge) if consumers is None else consumers
        new_out = node.outputs[0]
        if rewire_graph_output and self.is_graph_output(edge):
            producer = self.producer(edge)
            if producer is None:
                raise ModelError(f"insert_node_on_edge: graph output '{edge}' has no producing node to "
                                 f"rewire; insert on an internal edge instead")
            upstream = self.fresh_name(f"{edge}_pre")
            producer.outputs = [upstream if o == edge else o for o in producer.outputs]
            self.replace_uses(edge, upstream, [n for n in self.nodes if all(n is not t for t in targets)])
            if edge in self.value_info:
                self.value_info[upstream] = self.value_info[edge].copy(upstream)
            node.inputs = [upstream if i == edge else i for i in node.inputs]
            node.outputs[0] = edge  # the node now produces the graph output; targets keep reading it
        else:
            self.replace_uses(edge, new_out, [n for n in targets if n is not node])
        self.add_node(node)

    def remove_node(self, node: Node, reconnect: bool = True) -> None:
        """Remove `node`.  With reconnect, readers of its first output read its first input instead
        (for pass-through ops: Identity, Dropout, Q/DQ pairs...).  Outputs still read elsewhere without
        reconnect raise ModelError (and the graph is left unchanged).
        """
        if node not in self.nodes:
            raise ModelError(f"remove_node: node '{node.name}' is not in graph '{self.name}'")
        can_reconnect = reconnect and bool(node.outputs) and bool(node.inputs) and bool(node.inputs[0])
        must_be_unused = node.outputs[1:] if can_reconnect else node.outputs
        for o in must_be_unused:
            if o and ([n for n in self.consumers(o) if n is not node] or self.is_graph_output(o)):
                raise ModelError(f"remove_node: output '{o}' of '{node.name}' ({node.op_type}) is still used; "
                                 f"rewire its consumers first")
        if can_reconnect:
            src, dst = node.inputs[0], node.outputs[0]
            if self.is_graph_output(dst):
                if self.is_graph_output(src) or self.producer(src) is None:
                    raise ModelError(
                        f"remove_node: cannot remove '{node.name}' ({node.op_type}): its output '{dst}' is a "
                        f"graph output and its input '{src}' is a graph input, initializer or output")
                self.nodes.remove(node)
                self.value_info.pop(src, None)
                self.declared_value_info.discard(src)
                self.rename_value(src, dst)  # the producer of src takes over the output name
            else:
                self.nodes.remove(node)
                self.replace_uses(dst, src)
        else:
            self.nodes.remove(node)
        for o in node.outputs if not can_reconnect or not self.is_graph_output(node.outputs[0]) \
                else node.outputs[1:]:
            self.value_info.pop(o, None)
            self.declared_value_info.discard(o)

    def replace_node(self, old: Node, new: Node | list[Node]) -> None:
        """Replace `old` by one or more nodes that produce the same output names."""
        news = new if isinstance(new, list) else [new]
        idx = self.nodes.index(old)
        self.nodes[idx:idx + 1] = news
        taken = {n.name for n in self.nodes if all(n is not x for x in news)}
        for n in news:
            if not n.name or n.name in taken:
                n.name = self.fresh_name(n.name or n.op_type, taken | self.value_names())
            taken.add(n.name)
        self.toposort()

    def remove_unused(self) -> None:
        """Drop nodes whose outputs reach no graph output, and initializers nobody reads."""
        live = set(self.output_names)
        kept: list[Node] = []
        for node in reversed(self.nodes):
            if any(o in live for o in node.outputs if o):
                kept.append(node)
                live.update(i for i in node.inputs if i)
                for sub in node.subgraphs():
                    live.update(sub.free_values())
        self.nodes = kept[::-1]
        for name in list(self.initializers):
            if name not in live:
                del self.initializers[name]
                self.initializer_types.pop(name, None)
        for name in list(self.opaque_initializers):
            if name not in live:
                del self.opaque_initializers[name]
        for name in list(self.value_info):
            if name not in live:
                del self.value_info[name]
                self.declared_value_info.discard(name)

    def _is_sorted(self) -> bool:
        available = set(self.input_names) | set(self.initializers) | set(self.opaque_initializers) | {""}
        available |= self._outer_names()
        for node in self.nodes:
            needs = set(node.inputs)
            for sub in node.subgraphs():
                needs |= sub.free_values()
            if not needs <= available:
                return False
            available.update(node.outputs)
        return True

    def _outer_names(self) -> set[str]:
        names: set[str] = set()
        g = self._outer
        while g is not None:
            names |= g.value_names()
            g = g._outer
        return names

    def toposort(self) -> None:
        """Stable topological sort (Kahn); ModelError naming the nodes of a cycle."""
        produced_by: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            for o in node.outputs:
                if o:
                    produced_by[o] = i
        deps: list[set[int]] = []
        for node in self.nodes:
            names = set(node.inputs)
            for sub in node.subgraphs():
                names |= sub.free_values()
            deps.append({produced_by[n] for n in names if n in produced_by})
        users: list[list[int]] = [[] for _ in self.nodes]
        indeg = [0] * len(self.nodes)
        for i, d in enumerate(deps):
            for j in d:
                users[j].append(i)
            indeg[i] = len(d)
        import heapq

        ready = [i for i, k in enumerate(indeg) if k == 0]
        heapq.heapify(ready)
        order: list[int] = []
        while ready:
            i = heapq.heappop(ready)
            order.append(i)
            for u in users[i]:
                indeg[u] -= 1
                if indeg[u] == 0:
                    heapq.heappush(ready, u)
        if len(order) != len(self.nodes):
            stuck = [self.nodes[i].name for i in range(len(self.nodes)) if indeg[i] > 0]
            raise ModelError(f"graph '{self.name}' has a cycle (or a self-dependent node) through nodes: "
                             f"{', '.join(stuck[:10])}{' ...' if len(stuck) > 10 else ''}")
        self.nodes = [self.nodes[i] for i in order]

    def validate(self) -> None:
        """Structural checks: every input defined, unique outputs and node names, acyclic."""
        seen_nodes: set[str] = set()
        produced: set[str] = set()
        for node in self.nodes:
            if node.name in seen_nodes:
                raise ModelError(f"graph '{self.name}': duplicate node name '{node.name}'")
            seen_nodes.add(node.name)
            for o in node.outputs:
                if o and o in produced:
                    raise ModelError(f"graph '{self.name}': value '{o}' is produced twice "
                                     f"(second time by node '{node.name}')")
                produced.add(o)
        self.toposort()
        available = (set(self.input_names) | set(self.initializers) | set(self.opaque_initializers)
                     | produced | self._outer_names() | {""})
        for node in self.nodes:
            for i in node.inputs:
                if i not in available:
                    raise ModelError(f"graph '{self.name}': node '{node.name}' ({node.op_type}) reads "
                                     f"'{i}', which is no graph input, initializer or node output "
                                     f"(missing initializer?)")
        for v in self.outputs:
            if v.name not in available:
                raise ModelError(f"graph '{self.name}': graph output '{v.name}' is never produced")

    def copy(self) -> Graph:
        """Deep copy; initializers are cloned."""
        return _copy.deepcopy(self)

    def __deepcopy__(self, memo: dict[int, Any]) -> Graph:
        g = Graph.__new__(Graph)
        memo[id(self)] = g
        for k, v in self.__dict__.items():
            if k == "initializers":
                g.initializers = {n: t.detach().clone() for n, t in v.items()}
            else:
                setattr(g, k, _copy.deepcopy(v, memo))
        return g

    def __repr__(self) -> str:
        return (f"Graph({self.name!r}, {len(self.nodes)} nodes, inputs={self.input_names}, "
                f"outputs={self.output_names}, opset={self.opset})")


def claim_name(base: str, taken: set[str]) -> str:
    """The first of base, base_1, base_2, ... not in `taken`, added to it (names for nodes / tensors written into an
    ONNX proto)."""
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name
