"""analysis.profile: onnxruntime per-node times charged to our ops and regions."""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from netquant.analysis.profile import OTHER, NodeMap, profile_onnx, region_times
from netquant.analysis.regions import find_regions
from netquant.api import quantize_onnx
from netquant.export import build_qdq_model
from tests.helpers.placement_models import conv_stack, stack_batches


@pytest.fixture(scope="module")
def quantized():
    return quantize_onnx(conv_stack(), stack_batches(), quiet=True, objective=None)


def test_fp32_profile_times_every_node_and_charges_all_of_it(quantized):
    from netquant.graph import to_onnx

    feeds = {"x": stack_batches(1, batch=1)[0]}
    prof = profile_onnx(to_onnx(quantized.graph, check=False), feeds, runs=5, warmup=1)
    assert prof.node_ms and all(v >= 0 for v in prof.node_ms.values())
    assert set(prof.op_types) >= {n for n in prof.node_ms if n in prof.op_types}
    regions = find_regions(quantized.qgraph)
    region_of = {op: r.anchor for r in regions for op in r.ops}
    times = region_times(prof, NodeMap(quantized.graph), region_of, set())
    assert sum(times.values()) == pytest.approx(prof.node_total_ms, rel=1e-9)
    assert {"conv0", "conv1", "conv2"} <= set(times)  # each conv (fused with its Relu by onnxruntime) is found


def test_int8_profile_maps_qlinearconv_back_to_its_conv(quantized):
    model, _, _ = build_qdq_model(quantized.qgraph)
    feeds = {"x": stack_batches(1, batch=1)[0]}
    prof = profile_onnx(model, feeds, runs=5, warmup=1)
    nmap = NodeMap(quantized.graph)
    qconvs = [n for n, t in prof.op_types.items() if t == "QLinearConv" and n in prof.node_ms]
    assert len(qconvs) == 3
    assert sorted(nmap.resolve(prof, n)[1] for n in qconvs) == ["conv0", "conv1", "conv2"]
    regions = find_regions(quantized.qgraph)
    region_of = {op: r.anchor for r in regions for op in r.ops}
    times = region_times(prof, nmap, region_of, {r.anchor for r in regions})
    for n in qconvs:
        anchor = nmap.resolve(prof, n)[1]
        assert times[anchor] >= prof.node_ms[n]
    # the input Quantize is charged to conv0 (its int8 consumer), the output Dequantize to conv2 (its producer)
    q_in = [n for n, t in prof.op_types.items() if t == "QuantizeLinear" and n in prof.node_ms]
    assert all(nmap.resolve(prof, n) == ("q", "x") for n in q_in)
    assert sum(times.values()) == pytest.approx(prof.node_total_ms, rel=1e-9)
    assert times.get(OTHER, 0.0) <= prof.node_total_ms


def test_profile_file_model_path(tmp_path, quantized):
    path = tmp_path / "m.onnx"
    onnx.save(build_qdq_model(quantized.qgraph)[0], str(path))
    prof = profile_onnx(path, {"x": np.zeros((1, 16, 24, 24), np.float32)}, runs=3, warmup=1)
    assert prof.runs == 3 and prof.node_total_ms > 0


def test_ort_requantizes_predicts_onnxruntimes_weight_quantization(quantized, tmp_path):
    """The static check agrees with what onnxruntime really builds: floating only the middle conv leaves it between a
    Dequantize and a Quantize (onnxruntime makes it QLinearConv with its own weights); floating the last two does not."""
    from netquant.analysis.profile import ort_requantizes
    from netquant.analysis.regions import keep_float
    from netquant.export.ort_kernels import ort_int8_kernels

    regions = {r.anchor: r for r in find_regions(quantized.qgraph)}
    for chosen, expected in ((["conv1"], {"conv1"}), (["conv1", "conv2"], set())):
        with keep_float(quantized.qgraph, [regions[a] for a in chosen]):
            model, _, _ = build_qdq_model(quantized.qgraph)
        assert ort_requantizes(model, set(chosen)) == expected
        path = tmp_path / f"{len(chosen)}.onnx"
        onnx.save(model, str(path))
        assert ort_int8_kernels(path)["QLinearConv"] == 3 - len(chosen) + len(expected)


def test_a_kept_profiled_session_gives_a_plain_sessions_outputs_and_the_same_graph(quantized, tmp_path):
    """keep_session: the profiled session's outputs equal a plain session's bit for bit (the dynamic step reads the
    files' outputs from it), and the optimized graph read back without its weights (side file) is the one onnxruntime
    ran: the same nodes and initializer names as a profile that drops its session."""
    from netquant.analysis.profile import cpu_session

    model = build_qdq_model(quantized.qgraph)[0]
    feeds = {"x": stack_batches(1, batch=1)[0]}
    kept = profile_onnx(model, feeds, runs=2, warmup=1, keep_session=True)
    plain = profile_onnx(model, feeds, runs=2, warmup=1)
    assert plain.session is None and kept.session is not None
    assert (kept.op_types, kept.inputs, kept.outputs, kept.initializers) == \
        (plain.op_types, plain.inputs, plain.outputs, plain.initializers)
    assert any(op == "QLinearConv" for op in kept.op_types.values()) and kept.initializers
    for got, want in zip(kept.session.run(None, feeds), cpu_session(model).run(None, feeds), strict=True):
        np.testing.assert_array_equal(got, want)
