"""Placement times the shapes a model is fed: dim 0 is cut to one sample only where it is a batch axis."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from netquant.analysis.placement import batch_axis
from netquant.api import quantize_onnx
from netquant.graph.ir import Value
from tests.helpers.ir import make_model


@pytest.mark.parametrize(("shape", "cut"), [
    (("batch", 3), True), (("N", 3), True), (("batch_size", 8), True), (("unk__12", 3), True),
    (("input_dynamic_axes_1", 4), True), ((None, 3), True), (None, True),
    (("p2o.DynamicDimension.0", 3, "?", "p2o.DynamicDimension.1"), True),  # PP-OCR's paddle2onnx files
    (("p2o.DynamicDimension.1", 3), False), (("frames", 256), False), (("seq", 8), False), ((16, 3), False), ((), False)])
def test_batch_axis_by_dim0(shape: tuple | None, cut: bool) -> None:
    assert batch_axis(Value("x", shape)) is cut


def _streaming(dim0: str) -> onnx.ModelProto:
    """x [dim0, 256] -> MatMul 256x256 -> Relu -> MatMul 256x64 (enough weights for placement to time it)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((256, 256)) * 0.06).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal((256, 64)) * 0.06).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "stream", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [dim0, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [dim0, 64])], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("dim0", "timed"), [("frames", 40), ("batch", 1)])
def test_placement_times_the_calibration_frames_not_one(dim0: str, timed: int) -> None:
    rng = np.random.default_rng(1)
    calib = [{"x": rng.standard_normal((40, 256)).astype(np.float32)} for _ in range(3)]
    qm = quantize_onnx(_streaming(dim0), calib, quiet=True, objective="balanced")
    assert qm.placement is not None
    assert qm.placement.measured["timed_shapes"] == {"x": [timed, 256]}
