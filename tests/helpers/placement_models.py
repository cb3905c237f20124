"""A conv stack big enough for placement to measure (> analysis.placement.MIN_WEIGHTS weights)."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tests.helpers.ir import make_model


def conv_stack(seed: int = 0, width: int = 48, size: int = 24) -> onnx.ModelProto:
    """x[N,16,size,size] -> Conv 3x3 (16->width) -> Relu -> Conv 3x3 (width->width) -> Relu -> Conv 3x3 (width->8)."""
    rng = np.random.default_rng(seed)
    inits, nodes = [], []
    prev, cin = "x", 16
    for i, (cout, k) in enumerate([(width, 3), (width, 3), (8, 3)]):
        w = (rng.standard_normal((cout, cin, k, k)) / np.sqrt(cin * k * k)).astype(np.float32)
        b = (0.1 * rng.standard_normal(cout)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(b, f"b{i}")]
        out = f"c{i}"
        nodes.append(helper.make_node("Conv", [prev, f"w{i}", f"b{i}"], [out], name=f"conv{i}", pads=[k // 2] * 4))
        if i < 2:
            nodes.append(helper.make_node("Relu", [out], [f"r{i}"], name=f"relu{i}"))
            out = f"r{i}"
        prev, cin = out, cout
    graph = helper.make_graph(nodes, "conv_stack", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                  ["N", 16, size, size])],
                              [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["N", 8, size, size])], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def stack_batches(n: int = 2, batch: int = 4, seed: int = 1, size: int = 24) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((batch, 16, size, size)).astype(np.float32) for _ in range(n)]
