"""Graph -> ONNX ModelProto / file, losslessly, validated by onnx.checker, written atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx
import torch

from netquant.errors import ModelError
from netquant.graph.attrs import encode_attribute
from netquant.graph.dtypes import onnx_elem_type, tensor_to_proto
from netquant.graph.ir import Graph, Node, Value

_PROTO_LIMIT = 2**31 - 2**24


def value_to_proto(value: Value) -> onnx.ValueInfoProto:
    vi = onnx.ValueInfoProto()
    vi.name = value.name
    if value.doc_string:
        vi.doc_string = value.doc_string
    if value.type_proto is not None:
        vi.type.ParseFromString(value.type_proto)
        return vi
    elem = value.elem_type
    if elem is None and value.dtype is not None:
        elem = onnx_elem_type(value.dtype)
    if elem is None and value.shape is None:
        return vi
    tt = vi.type.tensor_type
    tt.elem_type = elem or 0
    if value.shape is not None:
        shape = tt.shape
        shape.SetInParent()
        for d in value.shape:
            dim = shape.dim.add()
            if isinstance(d, int):
                dim.dim_value = d
            elif isinstance(d, str):
                dim.dim_param = d
    return vi


def node_to_proto(node: Node, opset_imports: dict[str, int]) -> onnx.NodeProto:
    proto = onnx.NodeProto()
    proto.name = node.name
    proto.op_type = node.op_type
    if node.domain:
        proto.domain = node.domain
    proto.input.extend(node.inputs)
    proto.output.extend(node.outputs)
    if node.doc_string:
        proto.doc_string = node.doc_string
    for key in node.attrs:
        proto.attribute.append(encode_attribute(
            key, node.attrs[key], node.attr_types.get(key),
            encode_graph=lambda g: graph_to_proto(g, opset_imports, is_subgraph=True)))
    for fld, val in node.extra.items():
        if fld not in proto.DESCRIPTOR.fields_by_name:
            continue
        if isinstance(val, str):
            setattr(proto, fld, val)
        else:
            target = getattr(proto, fld)
            for raw in val:
                target.add().ParseFromString(raw)
    return proto


def graph_to_proto(graph: Graph, opset_imports: dict[str, int] | None = None, *, ir_version: int = 10,
                   is_subgraph: bool = False, into: onnx.GraphProto | None = None,
                   headers_above: int | None = None) -> onnx.GraphProto:
    """GraphProto of a graph; initializers are listed among the inputs too when ir_version < 4.
    into: an empty GraphProto to fill (e.g. `model.graph`: the weights are written once, not copied).
    headers_above: float32 initializers of more bytes than this are written as headers only (name, type, dims, no
    data: a caller fills those it needs, fill_initializer)."""
    opsets = opset_imports if opset_imports is not None else graph.opset_imports
    gp = onnx.GraphProto() if into is None else into
    gp.name = graph.name
    if graph.doc_string:
        gp.doc_string = graph.doc_string
    gp.node.extend(node_to_proto(n, opsets) for n in graph.nodes)
    gp.input.extend(value_to_proto(v) for v in graph.inputs)
    listed = set(graph.input_names)
    for v in graph.initializer_inputs:  # overridable defaults; typed from the current tensor
        if v.name in graph.initializers:
            t = graph.initializers[v.name]
            elem = graph.initializer_types.get(v.name) or onnx_elem_type(t.dtype)
            gp.input.append(onnx.helper.make_tensor_value_info(v.name, elem, list(t.shape)))
            listed.add(v.name)
        elif v.name in graph.opaque_initializers:
            gp.input.append(value_to_proto(v))
            listed.add(v.name)
    if ir_version < 4 and not is_subgraph:
        for name, t in graph.initializers.items():
            if name not in listed:
                elem = graph.initializer_types.get(name) or onnx_elem_type(t.dtype)
                gp.input.append(onnx.helper.make_tensor_value_info(name, elem, list(t.shape)))
    gp.output.extend(value_to_proto(v) for v in graph.outputs)
    for name, t in graph.initializers.items():
        if headers_above is not None and isinstance(t, torch.Tensor) and t.dtype == torch.float32 and \
                name not in graph.initializer_types and t.numel() * 4 > headers_above:
            gp.initializer.add(name=name, data_type=onnx.TensorProto.FLOAT, dims=t.shape)
        else:
            tensor_to_proto(t, name, graph.initializer_types.get(name), into=gp.initializer.add())
    for raw in graph.opaque_initializers.values():
        gp.initializer.add().ParseFromString(raw)
    for raw in graph.sparse_initializers:
        gp.sparse_initializer.add().ParseFromString(raw)
    live = graph.value_names() | graph.free_values()
    for name in graph.value_info:
        if name in graph.declared_value_info and name in live:
            gp.value_info.append(value_to_proto(graph.value_info[name]))
    return gp


def fill_initializer(t: onnx.TensorProto, value: torch.Tensor) -> None:
    """Write `value`'s data into header-only tensor `t` (graph_to_proto's headers_above), in place."""
    if tuple(t.dims) != tuple(value.shape) or value.dtype != torch.float32:
        raise ValueError(f"initializer '{t.name}': header {list(t.dims)} float32, value {tuple(value.shape)} "
                         f"{value.dtype}")
    t.raw_data = value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def to_onnx(graph: Graph, *, check: bool = True, headers_above: int | None = None) -> onnx.ModelProto:
    """ModelProto of a graph (lossless w.r.t. the loaded model); onnx.checker-validated when check.
    headers_above: see graph_to_proto (no check then: the model is incomplete until filled)."""
    info = graph.model_info
    model = onnx.ModelProto()
    model.ir_version = info.ir_version
    model.producer_name = info.producer_name
    model.producer_version = info.producer_version
    model.domain = info.domain
    model.model_version = info.model_version
    model.doc_string = info.doc_string
    for domain, version in graph.opset_imports.items():
        op = model.opset_import.add()
        op.domain = domain
        op.version = version
    for key, val in info.metadata_props.items():
        p = model.metadata_props.add()
        p.key, p.value = key, val
    for raw in info.functions:
        model.functions.add().ParseFromString(raw)
    for raw in info.training_info:
        model.training_info.add().ParseFromString(raw)
    graph_to_proto(graph, ir_version=info.ir_version, into=model.graph, headers_above=headers_above)
    if check and headers_above is None:
        check_model(model, f"graph '{graph.name}'")
    return model


def fill_output_shapes(model: onnx.ModelProto, graph: Graph) -> list[str]:
    """Give main-graph outputs declared without a shape, element type or any type (onnxruntime runs them) the type
    shape inference found, as onnx.checker requires for a model's outputs; returns the outputs whose type stays
    incomplete."""
    unknown = []
    for vi in model.graph.output:
        kind = vi.type.WhichOneof("value")
        if kind not in (None, "tensor_type"):
            continue
        tt = vi.type.tensor_type
        if kind == "tensor_type" and tt.HasField("shape") and tt.elem_type:
            continue
        inferred = graph.value_info.get(vi.name)
        elem = tt.elem_type or (inferred.elem_type or (onnx_elem_type(inferred.dtype) if inferred.dtype is not None
                                                       else None) if inferred is not None else None)
        if kind == "tensor_type" and tt.HasField("shape"):
            shape: tuple[int | str | None, ...] | None = tuple(
                d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in tt.shape.dim)
        else:
            shape = inferred.shape if inferred is not None else None
        if not elem or shape is None:
            unknown.append(vi.name)
            continue
        doc = vi.doc_string
        vi.CopyFrom(value_to_proto(Value(vi.name, elem_type=elem, shape=shape, doc_string=doc)))
    return unknown


def check_model(model: onnx.ModelProto, where: str) -> None:
    """onnx.checker on a model (via a temp file above the 2 GiB protobuf limit); ModelError if invalid."""
    try:
        if model.ByteSize() < _PROTO_LIMIT:
            onnx.checker.check_model(model)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                path = os.path.join(tmp, "model.onnx")
                onnx.save_model(model, path, save_as_external_data=True, location="model.data")
                onnx.checker.check_model(path)
    except onnx.checker.ValidationError as exc:
        raise ModelError(f"{where} fails onnx.checker: {str(exc).splitlines()[0][:500]}") from exc


def save_onnx(graph: Graph, path: str | os.PathLike, *, external_data: bool | None = None,
              check: bool = True, size_threshold: int = 1024) -> None:
    """Write the graph to `path` atomically (whole file or nothing), checked by onnx.checker.

    external_data: None = automatically above 2 GiB; True = tensors of at least `size_threshold` bytes
    go to '<file name>.data' next to the model.
    """
    path = Path(path)
    model = to_onnx(graph, check=check)
    if external_data is None:
        external_data = model.ByteSize() >= _PROTO_LIMIT
    path.parent.mkdir(parents=True, exist_ok=True)
    tmpdir = tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        tmp_model = os.path.join(tmpdir, path.name)
        location = f"{path.name}.data"
        if external_data:
            onnx.save_model(model, tmp_model, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=location, size_threshold=size_threshold)
            data = os.path.join(tmpdir, location)
            if os.path.exists(data):
                os.replace(data, path.parent / location)
        else:
            onnx.save_model(model, tmp_model)
        os.replace(tmp_model, path)
    except OSError as exc:
        raise ModelError(f"cannot write ONNX model to {path}: {exc}") from exc
    finally:
        shutil.rmtree(tmpdir, ignore_errors=True)
