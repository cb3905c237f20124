"""Quantizer steps: user overrides are applied while the configs are built, the platform hook runs last."""

from __future__ import annotations

import dataclasses

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from netquant.core.spec import Granularity, QuantSpec
from netquant.core.tensor_config import QuantState
from netquant.graph import load_onnx
from netquant.graph.op_config import OpQuantConfig, TensorRole
from netquant.passes import OpSelector, Override, build_quant_graph
from netquant.platforms import get_platform
from tests.helpers.ir import make_model


def conv_relu_concat() -> onnx.ModelProto:
    """x -> Conv -> Relu -> y1; Concat(y1, x) -> y2."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((3, 3, 1, 1)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "B")
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["c"], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Concat", ["r", "x"], ["y"], name="cat", axis=1)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 6, 4, 4])], [w, b])
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_platform_hook_runs_after_the_user_overrides() -> None:
    seen: dict[str, QuantSpec] = {}

    def hook(oc: OpQuantConfig, graph: object) -> None:
        w = oc.weight_config()
        if w is not None:
            seen[oc.op.name] = w.spec  # what the overrides left
            w.spec = w.spec.with_(bits=6)  # the hook has the last word

    int4 = QuantSpec.int8().with_(bits=4)
    platform = dataclasses.replace(get_platform("tflite_int8"), op_hook=hook)
    qg = build_quant_graph(load_onnx(conv_relu_concat()), platform,
                           [Override(OpSelector(op_type="Conv"), weight=int4)])
    assert seen["conv"].bits == 4 and seen["conv"].granularity is Granularity.PER_TENSOR
    assert qg.op_configs["conv"].weight_config().spec.bits == 6


def test_configs_by_step_fusion_bias_and_shared_scale_group() -> None:
    from netquant.platforms.builtin import FULL_INTEGER_FUSIONS, FULL_INTEGER_RULES

    full_integer = get_platform("tflite_int8").with_(rules=FULL_INTEGER_RULES, fusions=FULL_INTEGER_FUSIONS)
    qg = build_quant_graph(load_onnx(conv_relu_concat()), full_integer)
    conv, relu, cat = (qg.op_configs[n] for n in ("conv", "relu", "cat"))
    assert conv.roles == {0: TensorRole.ACTIVATION, 1: TensorRole.WEIGHT, 2: TensorRole.BIAS}
    assert conv.inputs[2].state is QuantState.PASSIVE_INIT  # bias: derived after calibration
    assert qg.fusions == {"relu": "conv"}
    assert conv.outputs[0].state is QuantState.OVERLAPPED and conv.outputs[0].dominated_by is relu.outputs[0]
    assert relu.inputs[0].dominated_by is relu.outputs[0]
    # Concat reads the Relu output (OVERLAPPED by it) and x (its own quantizer, shared with the Conv's input)
    assert cat.inputs[0].state is QuantState.OVERLAPPED and cat.inputs[0].dominated_by is relu.outputs[0]
    assert cat.inputs[1].dominated_by is conv.inputs[0]
    (group,) = qg.shared_scale_groups
    assert group == [cat.inputs[0], cat.inputs[1], cat.outputs[0]]
