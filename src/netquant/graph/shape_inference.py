"""Shape and type inference through onnx (best effort, never fatal)."""

from __future__ import annotations

import os
import tempfile
import warnings

import onnx

_PROTO_LIMIT = 2**31 - 2**20  # protobuf's 2 GiB limit, with headroom


def infer_model_shapes(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """onnx shape inference with data propagation; None (and a warning) when onnx cannot infer.

    Models above the 2 GiB protobuf limit are inferred with their weights stripped (shapes of
    initializers stay known from the dims).
    """
    try:
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
