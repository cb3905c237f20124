"""Export validation reuses calibration's FP32 outputs of the kept batches: same numbers as running them again."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

import netquant
from netquant.export import export_qdq
from netquant.export.validate import calibration_fp32, validation_feeds
from tests.helpers.onnx_models import calib_batches, conv_relu_gemm


def _quantized() -> netquant.QuantizedModel:
    return netquant.quantize_onnx(conv_relu_gemm(), calib_batches((4, 3, 8, 8), n=5), quiet=True, batch_size=4)


def test_calibration_keeps_the_fp32_outputs_of_the_validation_batches() -> None:
    qgraph = _quantized().qgraph
    assert len(qgraph.validation_batches) == len(qgraph.validation_fp32) == 3
    fresh = qgraph.executor(fake_quant=False)
    for batch, kept in zip(qgraph.validation_batches, qgraph.validation_fp32, strict=True):
        with torch.no_grad():
            y = fresh.run(batch)["y"]
        assert torch.equal(kept["y"], y)  # bit for bit what validation would compute


def test_export_agreement_is_the_same_with_and_without_the_cache(tmp_path: Path) -> None:
    qm = _quantized()
    assert calibration_fp32(qm.qgraph, validation_feeds(qm.qgraph)) is not None
    cached = export_qdq(qm, tmp_path / "a.onnx", check_kernels=False)
    qm.qgraph.validation_fp32 = []  # no cache: validation runs the FP32 executor itself
    fresh = export_qdq(qm, tmp_path / "b.onnx", check_kernels=False)
    assert cached.output_cosine == fresh.output_cosine
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


def test_cache_is_not_used_for_other_feeds_or_an_edited_graph() -> None:
    qgraph = _quantized().qgraph
    feeds = validation_feeds(qgraph)
    other = [{k: v + np.float32(1) for k, v in f.items()} for f in feeds]
    assert calibration_fp32(qgraph, other) is None
    assert calibration_fp32(qgraph, feeds[:1]) is None
    qgraph.graph.initializers["W"].mul_(2)  # an in-place edit after calibration
    assert calibration_fp32(qgraph, feeds) is None


def test_placement_all_int8_fake_quant_run_is_reused_bit_for_bit(tmp_path: Path) -> None:
    """analysis.sensitivity's all-INT8 loss run keeps its graph outputs on the first batch (fake_quant_run); export
    validation takes them for that batch only where the quant state, the feeds and the exact sums are the same."""
    from netquant.analysis.regions import find_regions, keep_float
    from netquant.analysis.sensitivity import LossMeter
    from netquant.core.int_kernels import Accumulation
    from netquant.export.validate import placement_fake_quant

    qm = _quantized()
    qgraph = qm.qgraph
    first = qgraph.validation_batches[0]
    meter = LossMeter(qgraph, [first])
    assert meter.loss([find_regions(qgraph)[0]]) > 0 and qgraph.fake_quant_run is None  # not the all-INT8 run
    meter.loss()
    run = qgraph.fake_quant_run
    assert run is not None
    with torch.no_grad():
        fresh = qgraph.executor(fake_quant=True).run(first)
    assert run.outputs.keys() == fresh.keys() and all(torch.equal(run.outputs[k], fresh[k]) for k in fresh)
    feeds = validation_feeds(qgraph)
    assert placement_fake_quant(qgraph, feeds[0], Accumulation.EXACT) is run.outputs
    assert placement_fake_quant(qgraph, feeds[1], Accumulation.EXACT) is None  # another batch
    assert placement_fake_quant(qgraph, feeds[0], Accumulation.PAIRWISE_INT16) is None  # other sums
    with keep_float(qgraph, [find_regions(qgraph)[0]]):
        assert placement_fake_quant(qgraph, feeds[0], Accumulation.EXACT) is None  # another quant state
    reused = export_qdq(qm, tmp_path / "a.onnx", check_kernels=False)
    qgraph.fake_quant_run = None
    fresh_export = export_qdq(qm, tmp_path / "b.onnx", check_kernels=False)
    assert reused.output_cosine == fresh_export.output_cosine


def test_validation_keeps_exactly_its_samples_of_large_batches(monkeypatch) -> None:
    """Batches of 16: validation keeps the first batch and 8 samples of the second (VALIDATION_SAMPLES 24, not 32);
    the second batch's other 8 samples are still observed (the same scales as with both batches kept whole), and the
    kept FP32 outputs are those of the kept samples. A static batch dim is never cut."""
    import netquant.passes.calibration as calibration
    from netquant.passes.calib_stack import samples_in
    from tests.helpers.quant_params import tensor_params

    data = calib_batches((16, 3, 8, 8), n=4)
    cut = netquant.quantize_onnx(conv_relu_gemm(), data, quiet=True, objective=None)
    q = cut.qgraph
    assert [samples_in(b) for b in q.validation_batches] == [16, 8] == [int(o["y"].shape[0]) for o in q.validation_fp32]
    assert q.calibration.executor_runs == 5  # 16, 8 + the other 8, 16, 16
    fresh = q.executor(fake_quant=False)
    with torch.no_grad():
        assert torch.equal(fresh.run(q.validation_batches[1])["y"], q.validation_fp32[1]["y"])
    monkeypatch.setattr(calibration, "VALIDATION_SAMPLES", 32)
    whole = netquant.quantize_onnx(conv_relu_gemm(), data, quiet=True, objective=None)
    assert [samples_in(b) for b in whole.qgraph.validation_batches] == [16, 16]
    a, b = tensor_params(cut), tensor_params(whole)
    assert a.keys() == b.keys() and all(torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a)
    monkeypatch.setattr(calibration, "VALIDATION_SAMPLES", 24)
    from tests.helpers.export_models import conv_net

    static = netquant.quantize_onnx(conv_net(batch=16), calib_batches((16, 3, 16, 16), n=3), quiet=True,
                                    objective=None)
    assert [samples_in(b) for b in static.qgraph.validation_batches] == [16, 16]  # a static batch dim: whole
