"""onnx.checker on a model's structure, without serializing its weights.

onnx.checker.check_model(proto) serializes the whole model for its C++ checker (about 0.6 s for BERT-base's 440 MB of
float weights, on top of the check); from a path it reads and parses the file again. The checker reads of a weight
its name, type, dims and whether its payload matches them; netquant's loader already refuses a payload that does not
(graph.load). `structural_copy` keeps every node, input, output, attribute, opset and function, and each large
initializer as one element of its own type: the rules the checker applies to the model's structure (IR version and
opsets, op schemas, types, names, topological order) are checked at the cost of a small model.
"""

from __future__ import annotations

import numpy as np
import onnx

from netquant.graph.light import tensor_bytes, with_initializers

STRUCTURE_BYTES = 4096  # initializers with at least this many bytes of payload are reduced to one element


def _one_element(t: onnx.TensorProto) -> onnx.TensorProto:
    """A tensor named and typed as `t`, dims [1], holding one zero (one empty string)."""
    out = onnx.TensorProto(name=t.name, data_type=t.data_type, dims=[1])
    if t.data_type == onnx.TensorProto.STRING:
        out.string_data.append(b"")
    else:
        out.raw_data = np.zeros(1, onnx.helper.tensor_dtype_to_np_dtype(t.data_type)).tobytes()
    return out


def _large(t: onnx.TensorProto) -> bool:
    if t.data_location == onnx.TensorProto.EXTERNAL:
        return True
    if t.data_type == onnx.TensorProto.STRING:
        return False
    return tensor_bytes(t) >= STRUCTURE_BYTES


def structural_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` whose main-graph initializers of STRUCTURE_BYTES or more (and external ones) are one element
    of their type (module docstring); `model` itself when it has none."""
    light = with_initializers(model, lambda t: _one_element(t) if _large(t) else None)
    return model if light is None else light


def check_structure(model: onnx.ModelProto) -> None:
    """onnx.checker.check_model on structural_copy(model): raises what the checker raises."""
    onnx.checker.check_model(structural_copy(model))
