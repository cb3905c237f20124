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
    """analysis.sensitivity's loss passes keep their graph outputs on the first batch, each under its quant state
    (fake_quant_runs); export validation takes them for that batch only where the quant state, the feeds and the exact
    sums are the same."""
    from netquant.analysis.regions import find_regions, keep_float
    from netquant.analysis.sensitivity import LossMeter
    from netquant.core.int_kernels import Accumulation
    from netquant.export.validate import placement_fake_quant

    qm = _quantized()
    qgraph = qm.qgraph
    first = qgraph.validation_batches[0]
    meter = LossMeter(qgraph, [first])
    feeds = validation_feeds(qgraph)
    region = find_regions(qgraph)[0]
    assert meter.loss([region]) > 0 and len(qgraph.fake_quant_runs) == 1  # kept under its own (floated) state
    assert placement_fake_quant(qgraph, feeds[0], Accumulation.EXACT) is None  # not the all-INT8 model's run
    with keep_float(qgraph, [region]):  # the model with that region float: its own run
        assert placement_fake_quant(qgraph, feeds[0], Accumulation.EXACT) is qgraph.fake_quant_runs[0].outputs
    meter.loss()
    run = qgraph.fake_quant_runs[-1]
    assert len(qgraph.fake_quant_runs) == 2
    with torch.no_grad():
        fresh = qgraph.executor(fake_quant=True).run(first)
    assert run.outputs.keys() == fresh.keys() and all(torch.equal(run.outputs[k], fresh[k]) for k in fresh)
    assert placement_fake_quant(qgraph, feeds[0], Accumulation.EXACT) is run.outputs
    assert placement_fake_quant(qgraph, feeds[1], Accumulation.EXACT) is None  # another batch
    assert placement_fake_quant(qgraph, feeds[0], Accumulation.PAIRWISE_INT16) is None  # other sums
    with keep_float(qgraph, find_regions(qgraph)[:2]):
        assert placement_fake_quant(qgraph, feeds[0], Accumulation.EXACT) is None  # a state no pass ran
    reused = export_qdq(qm, tmp_path / "a.onnx", check_kernels=False)
    qgraph.fake_quant_runs = []
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


def _batch1(threads: int) -> netquant.QuantizedModel:
    return netquant.quantize_onnx(conv_relu_gemm(), calib_batches((1, 3, 8, 8), n=5), quiet=True, threads=threads)


def test_the_budget_fp32_reference_is_calibrations_first_batch_bit_for_bit() -> None:
    """On one torch thread calibration keeps its FP32 run of the first batch (graph outputs and the loss's compared
    tensors); the budget's LossMeter takes it instead of running that batch again, bit for bit the same reference."""
    from netquant.analysis.sensitivity import LossMeter, compared_tensors
    from netquant.passes.calibration import graph_state
    from netquant.platforms.threads import thread_scope

    q = _batch1(1).qgraph
    ref = q.reference_run
    assert ref is not None and set(compared_tensors(q)) <= ref.tensors.keys()
    with torch.no_grad():
        fresh = q.executor(fake_quant=False).run(q.validation_batches[0], outputs=compared_tensors(q))
    assert all(torch.equal(ref.tensors[k], fresh[k]) for k in fresh)
    with thread_scope(1):
        meter = LossMeter(q, [q.validation_batches[0]])
        assert meter._calibration_reference() is not None  # taken, not run again
    assert torch.equal(meter.reference["y"], fresh["y"].reshape(-1).float())
    assert ref.serves(q.graph, q.validation_batches[0], graph_state(q.graph))
    assert not ref.serves(q.graph, q.validation_batches[1], graph_state(q.graph))  # another batch
    q.graph.initializers["W"].mul_(2)  # an edit after calibration: another graph state
    assert not ref.serves(q.graph, q.validation_batches[0], graph_state(q.graph))
    assert _batch1(2).qgraph.reference_run is None  # two torch threads: not the budget's one-thread sums


def test_where_later_batches_run_on_sample_threads_the_first_runs_on_one_thread_too(monkeypatch) -> None:
    """Two torch threads but later batches on two sample threads (the thread policy's default): the small first batch
    runs on one thread as they do, so its FP32 values are the budget's reference, bit for bit a one-thread run; torch's
    two threads are back after."""
    import netquant.passes.calibration as calibration
    from netquant.analysis.sensitivity import compared_tensors
    from netquant.platforms.threads import thread_scope

    monkeypatch.setattr(calibration, "sample_workers", lambda: 2)
    with thread_scope(2):
        q = netquant.quantize_onnx(conv_relu_gemm(), calib_batches((1, 3, 8, 8), n=5), quiet=True,
                                   objective=None).qgraph
        assert torch.get_num_threads() == 2
    ref = q.reference_run
    assert ref is not None
    with thread_scope(1), torch.no_grad():
        fresh = q.executor(fake_quant=False).run(q.validation_batches[0], outputs=compared_tensors(q))
    assert all(torch.equal(ref.tensors[k], fresh[k]) for k in fresh)


def test_placement_onnxruntime_runs_are_kept_and_reused_bit_for_bit(tmp_path: Path, monkeypatch) -> None:
    """Placement's warm-up runs of the files it times (the source FP32 model, the INT8 files) are kept, each
    onnxruntime's own outputs; export validation takes such a run for the batch it ran on where it runs that very
    model object with the same threads: one onnxruntime run fewer, the same report and bytes as running it again."""
    import netquant.export.validate as validate
    from netquant.analysis.profile import cpu_session
    from netquant.export.onnx_qdq import build_qdq_model, quant_state
    from netquant.passes.quant_graph import EngineRun, FP32Session, WholeModelTiming
    from tests.helpers.export_models import conv_net

    data = calib_batches((1, 3, 16, 16), n=5)
    placed = netquant.quantize_onnx(conv_net(channels=64), data, quiet=True, threads=1)
    assert placed.placement is not None and "source_fp32_wall_ms" in placed.placement.measured  # it timed files
    assert len(placed.qgraph.engine_runs) >= 2
    for run in placed.qgraph.engine_runs:
        again = cpu_session(run.model, run.threads).run(None, run.feeds)
        assert len(again) == len(run.outputs) and all(np.array_equal(a, b) for a, b in zip(again, run.outputs))

    qm = netquant.quantize_onnx(conv_net(channels=64), data, quiet=True, threads=1, objective=None)
    q = qm.qgraph
    model = build_qdq_model(q, share=True)[0]  # what placement times and export then writes: one object
    feeds = validation_feeds(q)[0]
    q.keep_engine_run(EngineRun(model, feeds, 1, cpu_session(model, 1).run(None, feeds)))
    source = _CountingSession(cpu_session(q.fp32_source, 1))
    q.fp32_session = FP32Session(q.fp32_source, 1, source)  # as placement leaves it
    q.keep_engine_run(EngineRun(q.fp32_source, feeds, 1, source.session.run(None, feeds)))
    q.whole_model_timing = WholeModelTiming(2.5, 1.25, {"x": (1, 3, 16, 16)}, 1, quant_state(q))  # no timing runs
    runs = []
    real = validate.run_ort
    monkeypatch.setattr(validate, "run_ort", lambda sess, feeds, where: runs.append(1) or real(sess, feeds, where))
    reused = export_qdq(qm, tmp_path / "a.onnx", check_kernels=False)
    assert len(runs) == reused.validation_batches - 1 == 2  # batch 0 from the kept run
    assert reused.vs_fp32 is not None and reused.vs_fp32.reference == "the source FP32 model in onnxruntime"
    assert source.runs == 2  # batches 1 and 2; batch 0 from the kept run
    source.runs = 0
    q.engine_runs = []
    runs.clear()
    fresh = export_qdq(qm, tmp_path / "b.onnx", check_kernels=False)
    assert len(runs) == fresh.validation_batches == 3
    assert source.runs == 3
    assert reused.output_cosine == fresh.output_cosine and reused.output_max_abs_diff == fresh.output_max_abs_diff
    assert reused.vs_fp32 is not None and fresh.vs_fp32 is not None
    assert [o.cosine for o in reused.vs_fp32.outputs] == [o.cosine for o in fresh.vs_fp32.outputs]
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    other = EngineRun(model, feeds, 2, [])
    assert not other.matches(model, feeds, 1) and not other.matches(onnx_copy(model), feeds, 2)
    assert not other.matches(model, validation_feeds(q)[1], 2)


def onnx_copy(model):
    import onnx

    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return copy


class _CountingSession:
    """An onnxruntime session that counts its runs."""

    def __init__(self, session) -> None:
        self.session, self.runs = session, 0

    def run(self, *args, **kwargs):
        self.runs += 1
        return self.session.run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.session, name)


def test_placement_source_session_of_other_threads_serves_outputs_not_timings(tmp_path: Path) -> None:
    """With two threads, export reads the FP32 outputs from placement's one-thread session of the source where it
    reuses placement's timing too (no session built for values the thread count does not change); where export times
    the two files itself, it builds a session with its own threads."""
    from netquant.analysis.profile import cpu_session
    from netquant.export.fidelity import fp32_reference
    from netquant.export.onnx_qdq import quant_state
    from netquant.passes.quant_graph import FP32Session, WholeModelTiming
    from netquant.platforms.threads import thread_scope
    from tests.helpers.export_models import conv_net

    qm = netquant.quantize_onnx(conv_net(channels=64), calib_batches((1, 3, 16, 16), n=5), quiet=True, threads=2,
                                objective=None)
    q = qm.qgraph
    source = _CountingSession(cpu_session(q.fp32_source, 1))
    q.fp32_session = FP32Session(q.fp32_source, 1, source)
    q.whole_model_timing = WholeModelTiming(2.5, 1.25, {"x": (1, 3, 16, 16)}, 1, quant_state(q))
    report = export_qdq(qm, tmp_path / "a.onnx", check_kernels=False)
    assert report.vs_fp32 is not None and report.vs_fp32.timed_by == "placement"
    assert report.vs_fp32.reference == "the source FP32 model in onnxruntime" and source.runs == 3
    with thread_scope(2):
        assert fp32_reference(q, timed=False)[0] is source
        assert fp32_reference(q, timed=True)[0] is not source  # timings need the scope's two threads
