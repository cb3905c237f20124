"""Bytes an exported file does not need: per-node metadata no engine reads, and initializers stored twice.

Exporters annotate every node (torch.onnx's dynamo exporter: metadata_props "namespace", "pkg.torch.onnx.stack_trace",
"pkg.torch.onnx.class_hierarchy", "pkg.torch.onnx.fx_node", "pkg.torch.onnx.name_scopes", ...; some tools a
doc_string). No inference engine reads them, and the quantized graph has nodes the source never had, so the
annotations no longer describe it: on a dynamo-exported BERT they are 0.4-2 MB of a 23-110 MB int8 file. The
model-level metadata_props (where netquant records its platform) are kept.

Equal initializers (same type, dims and bytes: e.g. the zero biases of freshly initialised layers, which exporters
write once per layer) are stored once (share_equal_initializers): every node reads the first; 24-31 KB of a
MiniLM-like encoder's file.
"""

from __future__ import annotations

import hashlib

import onnx

from netquant.graph.light import remove_where


def _subgraphs(node: onnx.NodeProto) -> list[onnx.GraphProto]:
    out: list[onnx.GraphProto] = []
    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            out.append(a.g)
        elif a.type == onnx.AttributeProto.GRAPHS:
            out.extend(a.graphs)
    return out


def _strip_nodes(nodes: list[onnx.NodeProto]) -> int:
    freed = 0
    for node in nodes:
        freed += sum(p.ByteSize() for p in node.metadata_props) + len(node.doc_string.encode())
        del node.metadata_props[:]
        node.ClearField("doc_string")
        for g in _subgraphs(node):
            freed += strip_graph_metadata(g)
    return freed


def strip_graph_metadata(graph: onnx.GraphProto) -> int:
    """Remove metadata_props and doc_string of every node, value (inputs, outputs, value_info) and initializer of
    `graph` and its subgraphs, in place. Returns about how many bytes that freed."""
    freed = _strip_nodes(list(graph.node))
    for v in (*graph.input, *graph.output, *graph.value_info):
        freed += sum(p.ByteSize() for p in v.metadata_props) + len(v.doc_string.encode())
        del v.metadata_props[:]
        v.ClearField("doc_string")
    for t in graph.initializer:
        freed += sum(p.ByteSize() for p in t.metadata_props) + len(t.doc_string.encode())
        del t.metadata_props[:]
        t.ClearField("doc_string")
    return freed


def strip_node_metadata(model: onnx.ModelProto) -> int:
    """strip_graph_metadata on the main graph and every local function's nodes, in place; the model's own
    metadata_props, doc_string and producer stay. Returns about how many bytes that freed."""
    freed = strip_graph_metadata(model.graph)
    for f in model.functions:
        freed += _strip_nodes(list(f.node))
    return freed


SHARE_MIN_ELEMENTS = 64  # smaller tensors (scalar scales and zero points) are left as they are


def _subgraph_reads(graph: onnx.GraphProto) -> set[str]:
    """Every input name any node of a subgraph of `graph` (at any depth) reads."""
    names: set[str] = set()
    for node in graph.node:
        for g in _subgraphs(node):
            names.update(i for n in g.node for i in n.input)
            names |= _subgraph_reads(g)
    return names


def share_equal_initializers(model: onnx.ModelProto) -> int:
    """Store each main-graph initializer of at least SHARE_MIN_ELEMENTS elements once: an initializer equal (data
    type, dims, raw bytes) to an earlier one is dropped and its readers read the earlier one, in place. Graph inputs
    and outputs, initializers kept in external files and names a subgraph reads are left alone. Returns the bytes
    freed."""
    graph = model.graph
    fixed = {v.name for v in (*graph.input, *graph.output)} | _subgraph_reads(graph)
    first: dict[tuple[int, tuple[int, ...], bytes], str] = {}
    by_name = {t.name: t for t in graph.initializer}
    rename: dict[str, str] = {}
    for t in graph.initializer:
        size = 1
        for d in t.dims:
            size *= d
        if t.name in fixed or size < SHARE_MIN_ELEMENTS or not t.raw_data or \
                t.data_location == onnx.TensorProto.EXTERNAL:
            continue
        key = (t.data_type, tuple(t.dims), hashlib.sha256(t.raw_data).digest())
        if key in first and by_name[first[key]].raw_data == t.raw_data:
            rename[t.name] = first[key]
        elif key not in first:
            first[key] = t.name
    if not rename:
        return 0
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name in rename:
                node.input[k] = rename[name]
    freed = sum(t.ByteSize() for t in graph.initializer if t.name in rename)
    remove_where(graph.initializer, lambda t: t.name in rename)
    remove_where(graph.value_info, lambda v: v.name in rename)
    return freed


__all__ = ["share_equal_initializers", "strip_graph_metadata", "strip_node_metadata"]
