"""Cross-layer equalization and high-bias absorption (passes.equalization): exact in FP32 (netquant's executor and
onnxruntime) on chains with depthwise convs, Relu / PRelu, residual joins and MatMul chains; equal ranges after."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import netquant
from netquant.graph import load_onnx, to_onnx
from netquant.graph.executor import Executor
from netquant.passes.equalization import ClipMode, EqualizationPass, find_pairs
from netquant.passes.rescale import in_channel_absmax, out_channel_absmax
from tests.helpers.repair_models import (
    cnn_inputs,
    cnn_model,
    mobilenet_v2_model,
    ort_run,
    rel,
    run_passes_alone,
    transformer_inputs,
    transformer_model,
)

equalized = run_passes_alone


@pytest.mark.parametrize("case", ["cnn", "transformer"])
def test_equalization_is_exact_and_equalizes_ranges(case):
    model, make = (cnn_model(), cnn_inputs) if case == "cnn" else (transformer_model(), transformer_inputs)
    calib = [make(8, s) for s in range(3)]
    x = make(16, 77)
    cle = EqualizationPass(absorb_bias=False)
    graph, ctx = equalized(model, calib, cle)
    pairs = {(r.first, r.seconds) for r in cle.results}
    if case == "cnn":  # conv -> depthwise -> conv, Gemm chain; not conv1 of the residual join's other branch
        assert pairs == {("conv1", ("dw",)), ("dw", ("pw",)), ("fc1", ("fc2",))}
        assert all(r.spread_after < r.spread_before / 3 for r in cle.results if r.first != "fc1")
    else:  # MatMul -> Add(bias) -> Relu -> MatMul
        assert pairs == {("mm_q", ("mm_o",))}
    assert len(ctx.repairs) == len(pairs)
    ref = ort_run(model, x)
    ours = Executor(graph).run({"x": torch.from_numpy(x)})
    theirs = ort_run(to_onnx(graph), x)
    for out, r, t in zip(model.graph.output, ref, theirs):
        assert rel(ours[out.name].numpy(), r) <= 1e-5
        assert rel(t, r) <= 1e-5
    # each pair's per-channel ranges meet: max|W1[c]| = max|W2[:, c]| (the chain's shared depthwise to 1%)
    for p in find_pairs(graph):
        r1 = out_channel_absmax(p.first, graph.initializers[p.first.weight])
        r2 = in_channel_absmax(p.seconds[0], graph.initializers[p.seconds[0].weight])
        np.testing.assert_allclose(r1.numpy(), r2.numpy(), rtol=1e-2)


def test_high_bias_absorption_is_exact_on_the_calibration_data_and_shrinks_ranges():
    model = cnn_model()
    calib = [cnn_inputs(8, s) for s in range(3)]
    plain, _ = equalized(model, calib, EqualizationPass(absorb_bias=False))
    cle = EqualizationPass(absorb_bias=True)
    graph, _ = equalized(model, calib, cle)
    assert sum(r.absorbed for r in cle.results) >= 1
    x = np.concatenate(calib)
    ref = ort_run(model, x)[0]
    assert rel(Executor(graph).run({"x": torch.from_numpy(x)})["y"].numpy(), ref) <= 1e-5
    assert rel(ort_run(to_onnx(graph), x)[0], ref) <= 1e-5
    # the Relu outputs the absorbing pairs read now start lower: max over channels of the minimum pre-activation
    absorbed = [r for r in cle.results if r.absorbed]
    for r in absorbed:
        pre = graph.node(r.first).outputs[0]
        lo_before = Executor(plain).run({"x": torch.from_numpy(x)}, outputs=[pre])[pre]
        lo_after = Executor(graph).run({"x": torch.from_numpy(x)}, outputs=[pre])[pre]
        axis = 1 if lo_before.dim() == 4 else -1
        mins_b = lo_before.movedim(axis, -1).reshape(-1, lo_before.shape[axis]).amin(0)
        mins_a = lo_after.movedim(axis, -1).reshape(-1, lo_after.shape[axis]).amin(0)
        assert float(mins_a.max()) < float(mins_b.max())


def test_relu6_pairs_are_skipped_unless_asked():
    model = cnn_model(relu6=True)
    graph = load_onnx(model)
    assert {(p.first.node.name, p.seconds[0].node.name) for p in find_pairs(graph)} == {("fc1", "fc2")}
    assert len(find_pairs(graph, ClipMode.RELU)) == 3


def test_relu6_pairs_are_equalized_exactly_with_per_channel_clips():
    """MobileNetV2-like chain (ReLU6 that clips 10-40% of some tensors, depthwise convs, residual joins): ClipMode.EXACT
    equalizes every expand -> depthwise -> project pair and keeps the FP32 outputs (executor and onnxruntime);
    ClipMode.RELU (AIMET's ReLU6 -> ReLU) equalizes the same pairs but changes the outputs."""
    model = mobilenet_v2_model()
    calib = [cnn_inputs(8, s) for s in range(3)]
    x = cnn_inputs(16, 77)
    pre = Executor(load_onnx(model)).run({"x": torch.from_numpy(x)}, outputs=["b0_ea", "b1_da"])
    assert all(float((v > 6).float().mean()) > 0.05 for v in pre.values())  # the clips do act
    ref = ort_run(model, x)[0]
    cle = EqualizationPass(absorb_bias=False, clip=ClipMode.EXACT)
    graph, _ = equalized(model, calib, cle)
    assert {(r.first, r.seconds) for r in cle.results} == {
        (f"b{i}_{a}", (f"b{i}_{b}",)) for i in range(2) for a, b in (("expand", "depthwise"), ("depthwise", "project"))}
    assert all(r.spread_after < r.spread_before / 3 for r in cle.results)
    assert cle.per_channel_clips == 4
    mins = [n for n in graph.nodes if n.op_type == "Min"]
    assert len(mins) == 4 and all(graph.initializers[n.inputs[1]].numel() > 1 for n in mins)
    assert [n.name for n in graph.nodes if n.op_type == "Clip"] == ["stem_relu6"]  # not equalized: put back
    assert rel(Executor(graph).run({"x": torch.from_numpy(x)})["y"].numpy(), ref) <= 1e-5
    assert rel(ort_run(to_onnx(graph), x)[0], ref) <= 1e-5
    aimet, _ = equalized(model, calib, EqualizationPass(absorb_bias=False, clip=ClipMode.RELU))
    assert rel(ort_run(to_onnx(aimet), x)[0], ref) > 1e-2


def test_equalization_through_quantize_onnx_is_deterministic(tmp_path):
    model = cnn_model()
    calib = [cnn_inputs(8, s) for s in range(3)]
    for i in range(2):
        q = netquant.quantize_onnx(model, calib, "onnxruntime_int8", passes=[EqualizationPass()], objective=None,
                                   quiet=True)
        q.export(tmp_path / f"m{i}.onnx")
        assert [r.repair for r in q.qgraph.repairs] == ["equalization"] * 3
    assert (tmp_path / "m0.onnx").read_bytes() == (tmp_path / "m1.onnx").read_bytes()
