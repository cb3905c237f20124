"""analysis.regions: regions of a quantized graph and keeping some in float without re-calibrating."""

from __future__ import annotations

import torch

from netquant.analysis.regions import find_regions, keep_float
from netquant.api import quantize_onnx
from netquant.core.tensor_config import QuantState
from netquant.export import build_qdq_model
from tests.helpers.placement_models import conv_stack, stack_batches


def _quantize(**kw):
    return quantize_onnx(conv_stack(), stack_batches(), quiet=True, objective=None, **kw)


def test_regions_are_weight_ops_with_their_fused_tails():
    regions = find_regions(_quantize().qgraph)
    assert [(r.anchor, r.ops) for r in regions] == [("conv0", ("conv0", "relu0")), ("conv1", ("conv1", "relu1")),
                                                    ("conv2", ("conv2",))]


def test_keep_float_equals_force_fp32_and_undoes_exactly():
    """Floating conv1's region on the calibrated graph gives the same fake-quant outputs as quantizing with conv1 and
    relu1 forced to FP32 (same tensors, same min-max ranges); undo restores the all-INT8 outputs bit for bit."""
    qm = _quantize()
    x = {"x": torch.from_numpy(stack_batches(1, seed=7)[0])}
    before = qm.run(x)["c2"]
    regions = {r.anchor: r for r in find_regions(qm.qgraph)}
    reference = _quantize(force_fp32=["name:conv1", "name:relu1"]).run(x)["c2"]
    with keep_float(qm.qgraph, [regions["conv1"]]):
        during = qm.run(x)["c2"]
        conv2_in = qm.qgraph.op_configs["conv2"].inputs[0]
        assert conv2_in.state is QuantState.ACTIVATED and conv2_in.emits  # quantizes r1 itself now
    assert torch.equal(during, reference)
    assert not torch.equal(during, before)
    assert torch.equal(qm.run(x)["c2"], before)


def test_weight_only_keeps_the_weights_quantized_and_the_rest_float():
    """keep_float(weights=False): the region's weight config keeps its state (the fake-quant run uses int8 weights),
    its activations and biases go float; the outputs lie between all-INT8's and float's; undo restores."""
    qm = _quantize()
    x = {"x": torch.from_numpy(stack_batches(1, seed=7)[0])}
    before = qm.run(x)["c2"]
    regions = {r.anchor: r for r in find_regions(qm.qgraph)}
    oc = qm.qgraph.op_configs["conv1"]
    weight_state = oc.weight_config().state
    with keep_float(qm.qgraph, [regions["conv1"]], weights=False):
        assert oc.weight_config().state is weight_state and weight_state is not QuantState.FP32
        assert all(c.state in (QuantState.FP32, QuantState.SOI) for c in oc.configs() if c is not oc.weight_config())
        weight_only = qm.run(x)["c2"]
        with keep_float(qm.qgraph, [regions["conv1"]]):
            floated = qm.run(x)["c2"]
    assert not torch.equal(weight_only, before) and not torch.equal(weight_only, floated)
    assert torch.equal(qm.run(x)["c2"], before) and oc.weight_config().state is weight_state


def test_keep_float_export_and_onnxruntime_requantizing_a_sandwiched_conv(tmp_path):
    """Export follows keep_float; onnxruntime's WeightBiasQuantization still runs a float Conv that has a Dequantize
    before and a Quantize after it as QLinearConv (its own per-tensor weights): placement must see that."""
    import onnx

    from netquant.export.ort_kernels import ort_int8_kernels

    qm = _quantize()
    regions = {r.anchor: r for r in find_regions(qm.qgraph)}
    counts = {}
    for tag, chosen in (("all", []), ("mid", ["conv1"]), ("tail", ["conv1", "conv2"])):
        with keep_float(qm.qgraph, [regions[a] for a in chosen]):
            model = build_qdq_model(qm.qgraph)[0]
        path = tmp_path / f"{tag}.onnx"
        onnx.save(model, str(path))
        counts[tag] = ort_int8_kernels(path).get("QLinearConv", 0)
        ours = sum(n.op_type == "Conv" and n.input[1].endswith("_DequantizeLinear_Output") for n in model.graph.node)
        assert ours == 3 - len(chosen)  # our file: float weights exactly where kept float
    assert counts == {"all": 3, "mid": 3, "tail": 1}
