"""Shape and type inference through onnx (best effort, never fatal)."""

from __future__ import annotations

import math
import os
import tempfile
import warnings

import onnx

from netquant.graph.light import with_initializers

_PROTO_LIMIT = 2**31 - 2**20  # protobuf's 2 GiB limit, with headroom
_STRIP_BYTES = 4096  # float initializers' payloads at least this large are left out of in-memory inference
_FLOAT_SIZES = {onnx.TensorProto.FLOAT: 4, onnx.TensorProto.FLOAT16: 2, onnx.TensorProto.BFLOAT16: 2,
                onnx.TensorProto.DOUBLE: 8}  # element bytes


def _without_float_payloads(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """A copy of `model` whose float initializers of _STRIP_BYTES or more keep name, type and dims but no values
    (None where there is none to strip). Their values decide no shape: onnx's data propagation reads integer
    tensors (shapes, indices, axes), and every integer or small initializer is kept whole. Serializing, copying and
    inferring then skip the weights (a transformer's hundreds of MB)."""
    def stripped(t: onnx.TensorProto) -> onnx.TensorProto | None:
        if t.data_type in _FLOAT_SIZES and t.data_location != onnx.TensorProto.EXTERNAL and \
                math.prod(t.dims) * _FLOAT_SIZES[t.data_type] >= _STRIP_BYTES:
            return onnx.TensorProto(name=t.name, data_type=t.data_type, dims=t.dims)
        return None

    return with_initializers(model, stripped)


def infer_model_shapes(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """onnx shape inference with data propagation; None (and a warning) when onnx cannot infer.

    Large float initializers are left out of the model onnx infers (_without_float_payloads: their values decide
    no shape; it reads their dims), so a transformer's weights are neither copied nor serialized. Models still
    above the 2 GiB protobuf limit are inferred with every payload stripped (shapes of initializers stay known from
    the dims). Only value_info and the graph outputs of the result are meant to be read.
    """
    try:
        light_model = _without_float_payloads(model)
        if light_model is not None:
            model = light_model
        if model.ByteSize() < _PROTO_LIMIT:
            return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
        light = onnx.ModelProto()
        light.CopyFrom(model)
        for init in light.graph.initializer:
            init.ClearField("raw_data")
            for fld in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                init.ClearField(fld)
            init.data_location = onnx.TensorProto.EXTERNAL
            del init.external_data[:]
            entry = init.external_data.add()
            entry.key, entry.value = "location", "stripped"
        with tempfile.TemporaryDirectory() as tmp:
            src, dst = os.path.join(tmp, "in.onnx"), os.path.join(tmp, "out.onnx")
            onnx.save(light, src)
            onnx.shape_inference.infer_shapes_path(src, dst, strict_mode=False, data_prop=True)
            return onnx.load(dst, load_external_data=False)
    except Exception as exc:  # onnx raises several types (InferenceError, RuntimeError, ...)
        warnings.warn(f"onnx shape inference failed ({type(exc).__name__}: {str(exc)[:300]}); "
                      f"continuing with the shapes declared in the model", stacklevel=3)
        return None


def infer_graph_shapes(graph) -> None:  # noqa: ANN001 (Graph; import cycle)
    """Refresh graph.value_info from onnx inference on the current graph (after edits)."""
    from netquant.graph.load import value_from_proto
    from netquant.graph.save import to_onnx

    inferred = infer_model_shapes(to_onnx(graph, check=False))
    if inferred is None:
        return
    for vi in (*inferred.graph.value_info, *inferred.graph.output):
        graph.value_info[vi.name] = value_from_proto(vi)
