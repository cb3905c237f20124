"""ONNX file / ModelProto -> Graph (external data, opsets 7..newest, shape inference through onnx)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from netquant.errors import ModelError
from netquant.graph.attrs import decode_attribute
from netquant.graph.dtypes import tensor_from_proto, torch_dtype
from netquant.graph.ir import Graph, ModelInfo, Node, Value
from netquant.graph.shape_inference import infer_model_shapes

ModelSource = str | os.PathLike | onnx.ModelProto | bytes


def value_from_proto(vi: onnx.ValueInfoProto) -> Value:
    """Value from a ValueInfoProto (tensor types decoded; other types kept as serialized TypeProto)."""
    value = Value(vi.name, doc_string=vi.doc_string)
    tp = vi.type
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        tt = tp.tensor_type
        value.elem_type = tt.elem_type or None
        value.dtype = torch_dtype(tt.elem_type) if tt.elem_type else None
        if tt.HasField("shape"):
            dims: list[int | str | None] = []
            for d in tt.shape.dim:
                which = d.WhichOneof("value")
                dims.append(d.dim_value if which == "dim_value" else d.dim_param if which == "dim_param" else None)
            value.shape = tuple(dims)
        if tp.denotation:
            value.type_proto = tp.SerializeToString()
    elif kind is not None:
        value.type_proto = tp.SerializeToString()
    return value


def graph_from_proto(gp: onnx.GraphProto, opset_imports: dict[str, int], outer: Graph | None = None,
                     where: str = "model") -> Graph:
    """Decode a GraphProto (subgraphs recursively).  Unnamed / duplicate node names get f'{op}_{i}'."""
    graph = Graph(name=gp.name or "graph", opset_imports=opset_imports)
    graph._outer = outer
    graph.doc_string = gp.doc_string
    for init in gp.initializer:
        if not init.name:
            raise ModelError(f"{where}: graph '{graph.name}' has an initializer without a name")
        value, elem_type = tensor_from_proto(init, where=f"{where}: initializer")
        if elem_type == onnx.TensorProto.STRING:
            graph.opaque_initializers[init.name] = init.SerializeToString()
            continue
        graph.initializers[init.name] = value
        if torch_dtype(elem_type) is not None and elem_type not in _NATIVE_TYPES:
            graph.initializer_types[init.name] = elem_type
    graph.sparse_initializers = [s.SerializeToString() for s in gp.sparse_initializer]
    # ir_version < 4 lists initializers among the inputs as well; those are not real inputs
    graph.inputs = [value_from_proto(vi) for vi in gp.input
                    if vi.name not in graph.initializers and vi.name not in graph.opaque_initializers]
    graph.initializer_inputs = [value_from_proto(vi) for vi in gp.input
                                if vi.name in graph.initializers or vi.name in graph.opaque_initializers]
    graph.outputs = [value_from_proto(vi) for vi in gp.output]
    for vi in gp.value_info:
        graph.value_info[vi.name] = value_from_proto(vi)
        graph.declared_value_info.add(vi.name)

    taken: set[str] = set()
    for i, np_ in enumerate(gp.node):
        name = np_.name
        if not name or name in taken:
            base = name or f"{np_.op_type}_{i}"
            name = base
            k = 1
            while name in taken:
                name = f"{base}_{k}"
                k += 1
        taken.add(name)
        texts = [name, np_.op_type, np_.domain, *np_.input, *np_.output]
        if any(isinstance(t, bytes) for t in texts):  # protobuf hands invalid UTF-8 of proto2 strings over as bytes
            bad = next(t for t in texts if isinstance(t, bytes))
            raise ModelError(f"{where}: node {i} of graph '{graph.name}' has a name, op type or value name that is "
                             f"not valid UTF-8 ({bad!r}); the file is corrupt: export the model again")
        node = Node(name=name, op_type=np_.op_type, domain=np_.domain, inputs=list(np_.input),
                    outputs=list(np_.output), doc_string=np_.doc_string)
        for attr in np_.attribute:
            if attr.ref_attr_name:
                raise ModelError(f"{where}: node '{name}' ({np_.op_type}) has attribute '{attr.name}' "
                                 f"referring to a function attribute; only function bodies may do that")

            def sub(g: onnx.GraphProto, _node: str = name) -> Graph:
                return graph_from_proto(g, opset_imports, outer=graph, where=f"{where}: subgraph of '{_node}'")

            node.attrs[attr.name] = decode_attribute(attr, decode_graph=sub)
            node.attr_types[attr.name] = attr.type
        for fld in ("overload", "metadata_props", "device_configurations"):
            if fld in np_.DESCRIPTOR.fields_by_name:
                val = getattr(np_, fld)
                if val:
                    node.extra[fld] = val if isinstance(val, str) else [v.SerializeToString() for v in val]
        graph.nodes.append(node)
    return graph


_NATIVE_TYPES = {t for t in range(1, 21)} | {onnx.TensorProto.FLOAT8E8M0}


def _read_model(source: ModelSource, load_external_data: bool) -> tuple[onnx.ModelProto, str, list[str]]:
    """(model, where, the external-data files read with it)."""
    if isinstance(source, onnx.ModelProto):
        return source, "<ModelProto>", []
    if isinstance(source, bytes):
        try:
            return onnx.load_from_string(source), "<bytes>", []
        except (DecodeError, RuntimeError, ValueError) as exc:
            raise ModelError(f"<bytes>: not a valid ONNX protobuf ({exc})") from exc
    path = Path(source)
    where = str(path)
    if not path.is_file():
        raise ModelError(f"{where}: ONNX file not found")
    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, UnicodeDecodeError) as exc:
        raise ModelError(f"{where}: not a valid ONNX protobuf, the file is truncated or corrupt ({exc}); "
                         f"re-export or re-download it") from exc
    files: list[str] = []
    if load_external_data:
        files = _check_external_files(model, path, where)
        try:
            onnx.external_data_helper.load_external_data_for_model(model, str(path.parent))
        except (OSError, ValueError, onnx.checker.ValidationError) as exc:
            raise ModelError(f"{where}: cannot read external tensor data next to the model ({exc}); keep the "
                             f".data file(s) in the same folder as the .onnx file") from exc
    return model, where, files


def _check_external_files(model: onnx.ModelProto, path: Path, where: str) -> list[str]:
    """ModelError naming the tensor and file when an external data file is missing or shorter than a tensor's
    offset + length says (a truncated copy or download), before onnx reads it; else the files (absolute, in first
    use order)."""
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    files: dict[str, None] = {}
    for t in _get_all_tensors(model):
        if not uses_external_data(t):
            continue
        info = ExternalDataInfo(t)
        file = path.parent / info.location
        files[os.path.abspath(file)] = None
        if not file.is_file():
            raise ModelError(f"{where}: tensor '{t.name}' is stored in '{file}', which does not exist; keep the "
                             "model's data file(s) in the same folder as the .onnx file, under the names it refers to")
        size = file.stat().st_size
        offset = int(info.offset or 0)
        if offset > size or (info.length is not None and offset + int(info.length) > size):
            need = offset + int(info.length or 0)
            raise ModelError(f"{where}: data file '{file}' holds {size} bytes but tensor '{t.name}' needs bytes "
                             f"{offset}..{need}: the file is truncated (an interrupted copy or download?); copy or "
                             "download it again")
    return list(files)


def load_onnx(source: ModelSource, *, infer_shapes: bool = True, load_external_data: bool = True,
              overridable_inputs: bool = True, on_proto: Callable[[onnx.ModelProto], None] | None = None) -> Graph:
    """Load an ONNX model (path, bytes or ModelProto) into a Graph.

    ModelError on a missing / malformed file, a model without graph, a node reading an undefined value
    (missing initializer) or a cycle.  Shapes and dtypes of intermediate values come from onnx shape
    inference (best effort: a model onnx cannot infer still loads, with fewer known shapes).
    overridable_inputs: keep graph inputs that name an initializer (IR >= 4, e.g. torch.onnx.export(...,
    keep_initializers_as_inputs=True)) as inputs a caller may feed (Graph.initializer_inputs, saved back); False:
    plain initializers, as onnxruntime runs them when they are not fed (quantization: the weights are constants).
    on_proto: called with the ModelProto as read once the graph has loaded (a caller's own check of it, without
    reading the file again).
    """
    model, where, data_files = _read_model(source, load_external_data)
    if not model.HasField("graph"):
        raise ModelError(f"{where}: the protobuf holds no graph (is this an ONNX model file?)")
    opsets = {("" if o.domain == "ai.onnx" else o.domain): int(o.version) for o in model.opset_import}
    if "" not in opsets and model.ir_version < 3:
        opsets[""] = 1
    graph = graph_from_proto(model.graph, opsets, where=where)
    if not overridable_inputs:
        graph.initializer_inputs = []
    info = ModelInfo(ir_version=model.ir_version, producer_name=model.producer_name,
                     producer_version=model.producer_version, domain=model.domain,
                     model_version=model.model_version, doc_string=model.doc_string,
                     metadata_props={p.key: p.value for p in model.metadata_props},
                     functions=[f.SerializeToString() for f in model.functions],
                     training_info=[t.SerializeToString() for t in model.training_info], data_files=data_files)
    graph.model_info = info
    graph.validate()
    if infer_shapes:
        inferred = infer_model_shapes(model)
        if inferred is not None:
            for vi in (*inferred.graph.value_info, *inferred.graph.output):
                v = value_from_proto(vi)
                if vi.name not in graph.value_info or graph.value_info[vi.name].shape is None:
                    graph.value_info[vi.name] = v
    if on_proto is not None:
        on_proto(model)
    return graph
