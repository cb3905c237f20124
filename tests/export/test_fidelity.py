"""export.fidelity: every exported file, run in its engine, compared with the FP32 model in onnxruntime (cosine, max
error, top-1 agreement, latency), recomputed here independently; the catastrophic-loss refusal and its threshold."""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import netquant
from netquant.errors import ConfigError, ExportError
from netquant.export.fidelity import DEFAULT_MIN_COSINE, compare_output, is_class_scores
from tests.conftest import CliInvoke
from tests.helpers.ir import make_model
from tests.helpers.onnx_models import calib_batches, conv_relu_gemm


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _sess(model: onnx.ModelProto | Path) -> ort.InferenceSession:
    src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(src, providers=["CPUExecutionProvider"])


def _batches(qm) -> list[np.ndarray]:
    return [b["x"].numpy() for b in qm.qgraph.validation_batches]


def _quantize(platform: str = "onnxruntime_int8", **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return netquant.quantize_onnx(conv_relu_gemm(), calib_batches((8, 3, 8, 8), n=4), platform=platform,
                                      quiet=True, **kw)


def _expected(engine_out: list[np.ndarray], batches: list[np.ndarray]) -> tuple[float, float, float]:
    """(cosine, max abs error, top-1 agreement) of the engine's outputs vs the source model in onnxruntime."""
    ref = [_sess(conv_relu_gemm()).run(None, {"x": x})[0] for x in batches]
    y, r = np.concatenate(engine_out), np.concatenate(ref)
    return _cos(y, r), float(np.abs(y.astype(np.float64) - r).max()), float(np.mean(y.argmax(1) == r.argmax(1)))


def test_onnxruntime_export_reports_fp32_vs_int8_recomputed_independently(tmp_path):
    qm = _quantize()
    path = tmp_path / "q.onnx"
    report = qm.export(path)
    c = report.vs_fp32
    batches = _batches(qm)
    assert c.engine == "onnxruntime" and c.reference == "the source FP32 model in onnxruntime"
    assert c.batches == len(batches) and c.samples == sum(len(x) for x in batches) and c.data == "calibration batches"
    cos, err, top1 = _expected([_sess(path).run(None, {"x": x})[0] for x in batches], batches)
    (o,) = c.outputs
    assert o.name == "y" and o.shape == (8, 5)
    assert o.cosine == pytest.approx(cos, abs=1e-9) and o.max_abs_err == pytest.approx(err, rel=1e-6)
    assert o.top1_agreement == pytest.approx(top1) and o.top1_positions == c.samples
    assert 0.99 < o.cosine < 1.0
    # latency: the calibration batch, interleaved rounds, median
    assert c.timed_batch == 8 and 3 <= c.timing_rounds <= 5 and c.int8_ms > 0 and c.fp32_ms > 0
    assert c.speedup == pytest.approx(c.fp32_ms / c.int8_ms)
    line = c.line()
    assert re.match(r"INT8 vs FP32 in onnxruntime: cosine 0\.99\d{3}, max err [\d.e-]+, top-1 agreement [\d.]+%, "
                    r"[\d.]+x (faster|slower) \(batch 8, median of \d\)", line), line
    s = qm.summary()["vs_fp32"]
    assert s[0]["outputs"][0]["cosine"] == o.cosine and s[0]["speedup"] == c.speedup
    assert json.loads(json.dumps(qm.summary()))["vs_fp32"] == s and qm.vs_fp32 == [c]
    qm.export(tmp_path / "q.json", format="json")
    assert json.loads((tmp_path / "q.json").read_text())["vs_fp32"][0]["outputs"][0]["top1_agreement"] == top1


def test_a_catastrophic_loss_is_refused_naming_the_output_unless_the_threshold_is_lowered(tmp_path):
    """A threshold above the file's cosine stands in for a broken file (which the default, 0.97, refuses: see
    test_broken_outputs_fall_below_the_default): ExportError with the numbers and the output, no file."""
    cos = _quantize().export(tmp_path / "ok.onnx").vs_fp32.outputs[0].cosine
    strict = _quantize(min_cosine=(1 + cos) / 2)
    path = tmp_path / "q.onnx"
    with pytest.raises(ExportError, match=r"loses too much against FP32 in onnxruntime .*output 'y': cosine "
                                          rf"{cos:.5f}.*min_cosine") as err:
        strict.export(path)
    assert "--min-cosine" in str(err.value) and not path.exists()
    assert strict.export(path, min_fp32_cosine=cos - 0.001).vs_fp32.outputs[0].cosine == pytest.approx(cos)
    with pytest.raises(ConfigError, match="min_cosine"):
        _quantize(min_cosine=1.5)


def test_broken_outputs_fall_below_the_default():
    """Hand-checked vectors: an all-zero output (cosine 0) and sign-flipped scores are far below DEFAULT_MIN_COSINE;
    top-1 agreement counts the rows whose argmax matches."""
    ref = np.array([[1.0, 2.0], [3.0, 4.0]], dtype=np.float32)
    zero = compare_output("y", [np.zeros_like(ref)], [ref])
    assert zero.cosine == 0.0 and zero.max_abs_err == 4.0 and zero.top1_agreement == 0.0  # argmax 0, FP32 1
    swapped = compare_output("y", [np.array([[1.0, 2.0], [4.0, 3.0]], dtype=np.float32)], [ref])
    assert swapped.cosine == pytest.approx((1 + 4 + 12 + 12) / 30) and swapped.top1_agreement == 0.5
    assert swapped.max_abs_err == 1.0
    assert zero.cosine < DEFAULT_MIN_COSINE and swapped.cosine < 1.0
    flipped = compare_output("y", [-ref], [ref])
    assert flipped.cosine == pytest.approx(-1.0) and flipped.cosine < DEFAULT_MIN_COSINE


def test_class_scores_are_2d_or_softmax_outputs():
    assert is_class_scores((8, 5), "Gemm") and not is_class_scores((8, 1), "Gemm")
    assert is_class_scores((8, 40, 6625), "Softmax") and not is_class_scores((8, 40, 384), "Add")
    assert not is_class_scores((8, 16, 4, 4), "Conv")
    conv = compare_output("c", [np.ones((2, 3, 4, 4), np.float32)], [np.ones((2, 3, 4, 4), np.float32)], "Conv")
    assert conv.top1_agreement is None and conv.cosine == pytest.approx(1.0)


def test_reference_only_platforms_compare_without_timing(tmp_path):
    """TensorRT's file is checked in the Q/DQ reference semantics: compared with FP32 there, not timed."""
    qm = _quantize("tensorrt_int8")
    c = qm.export(tmp_path / "t.onnx").vs_fp32
    assert c.engine.startswith("the Q/DQ reference") and c.speedup is None and c.int8_ms is None
    assert c.outputs[0].cosine > 0.99 and "faster" not in c.line()


def test_cli_prints_fp32_vs_int8_and_refuses_below_min_cosine(run_cli: CliInvoke, tmp_path: Path):
    model, calib = tmp_path / "m.onnx", tmp_path / "c.npy"
    onnx.save(conv_relu_gemm(), model)
    np.save(calib, np.concatenate(calib_batches((8, 3, 8, 8), n=4)))
    out, params = tmp_path / "q.onnx", tmp_path / "q.json"
    ok = run_cli("quantize", model, "--calib", calib, "-o", out, "--batch-size", "8", "--json", params)
    assert ok.exit_code == 0, ok.output
    text = " ".join(re.sub("[│┃┌┐└┘├┤─┬┴┼━]", " ", ok.output).split())
    stored = json.loads(params.read_text())["vs_fp32"][0]
    cos = stored["outputs"][0]["cosine"]
    assert f"INT8 vs FP32 in onnxruntime: cosine {cos:.5f}" in text and "top-1 agreement" in text
    assert "(batch 8, median of" in text
    out.unlink()
    report = tmp_path / "r.md"
    assert run_cli("quantize", model, "--calib", calib, "-o", out, "--batch-size", "8", "-q", "--report",
                   report).exit_code == 0
    section = report.read_text().split("## FP32 vs INT8 in onnxruntime\n\n")[1].split("## Per layer")[0]
    assert section.startswith("24 samples of the calibration batches; FP32: the source FP32 model in onnxruntime; "
                              "timed at batch 8, median of")
    assert re.search(r"- `y`: cosine 0\.99\d{3}, max err [\d.e-]+, top-1 agreement [\d.]+%", section), section
    out.unlink()
    refused = run_cli("quantize", model, "--calib", calib, "-o", out, "--batch-size", "8",
                      "--min-cosine", str((1 + cos) / 2))
    assert refused.exit_code == 1 and not out.exists()
    assert "loses too much against FP32" in refused.output and "output 'y'" in refused.output
    lowered = run_cli("quantize", model, "--calib", calib, "-o", out, "--batch-size", "8", "--min-cosine", "0.5", "-q")
    assert lowered.exit_code == 0 and out.exists()


# ---- the other engines: their outputs vs FP32 in onnxruntime --------------------------------------------------

def test_litert_export_compares_litert_outputs_with_fp32(tmp_path):
    litert = pytest.importorskip("ai_edge_litert.interpreter")
    qm = _quantize("tflite_int8")
    path = tmp_path / "q.tflite"
    c = qm.export(path).vs_fp32
    it = litert.Interpreter(model_path=str(path), num_threads=1)
    it.allocate_tensors()
    d_in, d_out = it.get_input_details()[0], it.get_output_details()[0]

    def run(x: np.ndarray) -> np.ndarray:
        ys = []
        for k in range(len(x)):
            it.set_tensor(d_in["index"], np.ascontiguousarray(x[k:k + 1].transpose(0, 2, 3, 1)))
            it.invoke()
            ys.append(it.get_tensor(d_out["index"]).copy())
        return np.concatenate(ys)

    batches = _batches(qm)
    cos, err, top1 = _expected([run(x) for x in batches], batches)
    assert c.engine == "LiteRT" and c.speedup is None
    assert c.outputs[0].cosine == pytest.approx(cos, abs=1e-9) and c.outputs[0].max_abs_err == pytest.approx(err)
    assert c.outputs[0].top1_agreement == pytest.approx(top1) and cos > 0.99


def test_openvino_export_compares_openvino_outputs_with_fp32(tmp_path):
    ov = pytest.importorskip("openvino")
    qm = _quantize("openvino_int8")
    path = tmp_path / "q.xml"
    c = qm.export(path).vs_fp32
    compiled = ov.Core().compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    batches = _batches(qm)
    cos, err, top1 = _expected([compiled({"x": x})[compiled.outputs[0]] for x in batches], batches)
    assert c.engine.startswith("OpenVINO") and c.speedup is None
    assert c.outputs[0].cosine == pytest.approx(cos, abs=1e-6) and c.outputs[0].top1_agreement == pytest.approx(top1)
    assert c.outputs[0].max_abs_err == pytest.approx(err, rel=1e-3, abs=1e-5) and cos > 0.99


def test_ncnn_export_compares_ncnn_outputs_with_fp32(tmp_path):
    pytest.importorskip("ncnn")
    pytest.importorskip("pnnx")
    from netquant.export.ncnn.runner import NcnnRunner

    qm = _quantize("ncnn_int8")
    path = tmp_path / "q.param"
    report = qm.export(path)
    c = report.vs_fp32
    runner = NcnnRunner(path, path.with_suffix(".bin"), int8=True)
    blobs = report.blob_names
    batches = _batches(qm)
    got = [runner.run_batch({"x": x}, [blobs["x"]], [blobs["y"]])[0].reshape(len(x), -1) for x in batches]
    cos, err, top1 = _expected(got, batches)
    assert c.engine == "ncnn" and c.speedup is None
    assert c.outputs[0].cosine == pytest.approx(cos, abs=1e-9) and c.outputs[0].top1_agreement == pytest.approx(top1)
    assert c.outputs[0].max_abs_err == pytest.approx(err) and cos > 0.99


def test_a_source_onnxruntime_cannot_run_falls_back_to_the_cleaned_graph_with_fp32_biases(tmp_path):
    """The reference is the source model where onnxruntime runs it, else the cleaned-up graph (same numbers here:
    clean-up is exact)."""
    qm = _quantize()
    expected = qm.export(tmp_path / "a.onnx").vs_fp32
    qm.qgraph.fp32_source = onnx.ModelProto()  # onnxruntime cannot load an empty model
    c = qm.export(tmp_path / "b.onnx").vs_fp32
    assert expected.reference == "the source FP32 model in onnxruntime"
    assert c.reference == "the cleaned-up FP32 graph in onnxruntime"
    assert c.outputs[0].cosine == pytest.approx(expected.outputs[0].cosine, abs=1e-6)


def test_placement_timing_of_the_same_files_is_reused_not_measured_again(tmp_path):
    """The export's FP32-vs-INT8 speed comes from placement's whole-model check when it timed this very file (same
    quant state) on batches shaped like the validation batches; any other state is timed again here."""
    from netquant.export.onnx_qdq import quant_state
    from netquant.passes.quant_graph import WholeModelTiming

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_onnx(conv_relu_gemm(), calib_batches((1, 3, 8, 8), n=4), quiet=True, objective=None)
    qm.qgraph.whole_model_timing = WholeModelTiming(2.5, 1.25, {"x": (1, 3, 8, 8)}, 1, quant_state(qm.qgraph))
    c = qm.export(tmp_path / "a.onnx").vs_fp32
    assert (c.fp32_ms, c.int8_ms, c.speedup, c.timed_batch, c.timed_by) == (2.5, 1.25, 2.0, 1, "placement")
    assert c.line().endswith("2.00x faster (batch 1, one thread, timed by placement) (3 samples of the calibration "
                             "batches)") and c.outputs[0].cosine > 0.99
    qm.qgraph.whole_model_timing = WholeModelTiming(2.5, 1.25, {"x": (1, 3, 8, 8)}, 1, ("another state",))
    c = qm.export(tmp_path / "b.onnx").vs_fp32
    assert c.timed_by == "" and c.timing_rounds >= 3 and c.fp32_ms != 2.5
    qm.qgraph.whole_model_timing = WholeModelTiming(2.5, 1.25, {"x": (4, 3, 8, 8)}, 1, quant_state(qm.qgraph))
    assert qm.export(tmp_path / "c.onnx").vs_fp32.timed_by == ""  # timed on batch 4, the batches hold 1


def test_placement_timing_is_kept_only_for_an_all_int8_placement() -> None:
    from netquant.analysis.placement.measure import whole_model_timing as placement_timing
    from netquant.api.placement import Placement, RegionDecision

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_onnx(conv_relu_gemm(), calib_batches((1, 3, 8, 8), n=4), quiet=True, objective=None)
    p = Placement("h", "onnxruntime_int8", "any", {}, "balanced", 0.02, "1 - output cosine")
    p.measured = {"source_fp32_wall_ms": 3.0, "all_int8_wall_ms": 2.0, "timed_shapes": {"x": [1, 3, 8, 8]}}
    p.regions = [RegionDecision("conv", "Conv", ["conv"], "int8", "faster")]
    t = placement_timing(p, qm.qgraph)
    assert t is not None and (t.fp32_ms, t.int8_ms, t.shapes, t.threads) == (3.0, 2.0, {"x": (1, 3, 8, 8)}, 1)
    p.regions.append(RegionDecision("fc", "Gemm", ["fc"], "float", "slower"))
    assert placement_timing(p, qm.qgraph) is None
    assert placement_timing(Placement("h", "onnxruntime_int8", "any", {}, "balanced", 0.02, "x"), qm.qgraph) is None


def test_placement_timing_of_a_placed_file_with_float_regions_is_kept() -> None:
    """A placement with INT8 and float regions timed its placed file against the source in the same rounds
    (placed_wall_ms): that pair is the export's timing; without that measurement, or with a region quantized at run
    time, there is none."""
    from netquant.analysis.placement.measure import whole_model_timing as placement_timing
    from netquant.api.placement import Placement, RegionDecision

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_onnx(conv_relu_gemm(), calib_batches((1, 3, 8, 8), n=4), quiet=True, objective=None)
    p = Placement("h", "onnxruntime_int8", "any", {}, "balanced", 0.02, "1 - output cosine")
    p.measured = {"source_fp32_wall_ms": 3.0, "all_int8_wall_ms": 4.0, "placed_wall_ms": 2.5,
                  "all_float_wall_ms": 3.1, "timed_shapes": {"x": [1, 3, 8, 8]}}
    p.regions = [RegionDecision("conv", "Conv", ["conv"], "int8", "faster"),
                 RegionDecision("fc", "Gemm", ["fc"], "float", "slower")]
    t = placement_timing(p, qm.qgraph)
    assert t is not None and (t.fp32_ms, t.int8_ms, t.shapes) == (3.0, 2.5, {"x": (1, 3, 8, 8)})
    qm.qgraph.dynamic_ops = {"fc"}
    assert placement_timing(p, qm.qgraph) is None
    qm.qgraph.dynamic_ops = set()
    del p.measured["placed_wall_ms"]
    assert placement_timing(p, qm.qgraph) is None
    p.regions = [RegionDecision("conv", "Conv", ["conv"], "float", "all float")]  # the all-float fallback: not kept
    assert placement_timing(p, qm.qgraph) is None


def test_placement_session_of_the_source_is_the_fp32_reference_and_changes_no_byte(tmp_path):
    """Placement's onnxruntime session of the source model (one thread) is export's FP32 reference where export runs
    with one thread too; a reference built afresh gives the same file and the same comparison."""
    from netquant.export import fidelity
    from netquant.platforms.threads import thread_scope
    from tests.helpers.transformer_models import small_bert, small_bert_batches

    qm = netquant.quantize_onnx(str(small_bert(tmp_path / "bert.onnx")), small_bert_batches(4), objective="balanced",
                                quiet=True)
    held = qm.qgraph.fp32_session
    assert held is not None and held.model is qm.qgraph.fp32_source and held.threads == 1
    fidelity._REFERENCES.pop(qm.qgraph, None)  # a reference the quantization may have memoised already
    with thread_scope(1):
        assert fidelity.fp32_reference(qm.qgraph)[0] is held.session
    fidelity._REFERENCES.pop(qm.qgraph, None)
    with thread_scope(2):  # other threads: a session of its own
        assert fidelity.fp32_reference(qm.qgraph)[0] is not held.session
    fidelity._REFERENCES.pop(qm.qgraph, None)
    qm.threads = 1
    reused = qm.export(tmp_path / "a.onnx").vs_fp32
    assert fidelity._REFERENCES[qm.qgraph].session is held.session
    fidelity._REFERENCES.pop(qm.qgraph, None)
    qm.qgraph.fp32_session = None
    fresh = qm.export(tmp_path / "b.onnx").vs_fp32
    assert fidelity._REFERENCES[qm.qgraph].session is not held.session
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    assert reused.reference == fresh.reference == "the source FP32 model in onnxruntime"
    assert [(o.name, o.cosine, o.max_abs_err) for o in reused.outputs] == \
        [(o.name, o.cosine, o.max_abs_err) for o in fresh.outputs]


def test_both_files_are_timed_on_placements_cut_of_the_first_batch_and_no_byte_changes(tmp_path):
    """Where placement timed (QuantizedGraph.timed_shapes: its first calibration sample), export times the two files
    on that cut of the first batch (or reuses placement's timing of them) instead of at the calibration batch; the
    comparison still covers every sample, and the file's bytes are the same whichever timing ran."""
    from netquant.export.onnx_qdq import quant_state
    from netquant.passes.quant_graph import WholeModelTiming

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_onnx(conv_relu_gemm(), calib_batches((8, 3, 8, 8), n=4), quiet=True, objective=None)
    assert qm.qgraph.timed_shapes is None  # no placement: timed at the calibration batch
    whole = qm.export(tmp_path / "a.onnx").vs_fp32
    assert whole.timed_batch == 8 and whole.timed_by == ""
    qm.qgraph.timed_shapes = {"x": (1, 3, 8, 8)}
    cut = qm.export(tmp_path / "b.onnx").vs_fp32
    assert cut.timed_batch == 1 and cut.timed_by == "" and 3 <= cut.timing_rounds <= 5
    assert cut.int8_ms > 0 and cut.fp32_ms > 0 and "(batch 1, median of" in cut.line()
    assert [(o.cosine, o.max_abs_err, o.top1_agreement) for o in cut.outputs] == \
        [(o.cosine, o.max_abs_err, o.top1_agreement) for o in whole.outputs]
    assert cut.samples == whole.samples == sum(len(x) for x in _batches(qm)) > 8
    qm.qgraph.whole_model_timing = WholeModelTiming(2.5, 1.25, {"x": (1, 3, 8, 8)}, 1, quant_state(qm.qgraph))
    reused = qm.export(tmp_path / "c.onnx").vs_fp32
    assert (reused.fp32_ms, reused.int8_ms, reused.timed_batch, reused.timed_by) == (2.5, 1.25, 1, "placement")
    qm.qgraph.timed_shapes = {"x": (1, 3, 4, 4)}  # not a cut along dim 0: the calibration batch again
    assert qm.export(tmp_path / "d.onnx").vs_fp32.timed_batch == 8
    files = {p.name: p.read_bytes() for p in tmp_path.glob("*.onnx")}
    assert len(files) == 4 and len(set(files.values())) == 1


def _two_matmuls(dim0: str) -> onnx.ModelProto:
    """x [dim0, 256] -> MatMul 256x256 -> Relu -> MatMul 256x64: weights enough for placement to time it."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((256, 256)) * 0.06).astype(np.float32), "w1"),
             numpy_helper.from_array((rng.standard_normal((256, 64)) * 0.06).astype(np.float32), "w2")]
    nodes = [helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [dim0, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [dim0, 64])], inits)
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("dim0", "timed"), [("batch", 1), ("frames", 40)])
def test_a_placed_model_is_timed_at_the_shapes_placement_timed(tmp_path, dim0: str, timed: int):
    """quantize_onnx with placement records the shapes it timed (one sample where dim 0 is a batch axis, the frames it
    is fed otherwise); the export times at those (placement's whole-model timing reused where the file is the
    all-INT8 one it timed) and compares every sample."""
    rng = np.random.default_rng(1)
    calib = [{"x": rng.standard_normal((40, 256)).astype(np.float32)} for _ in range(3)]
    # allow_float: on one sample of this small model INT8 can time slower than FP32 (x86 without VNNI), and the
    # timed shapes are the subject here, not that verdict
    qm = netquant.quantize_onnx(_two_matmuls(dim0), calib, objective="balanced", quiet=True, allow_float=True)
    assert qm.qgraph.timed_shapes == {"x": (timed, 256)}
    c = qm.export(tmp_path / "q.onnx").vs_fp32
    assert c.timed_batch == timed and c.int8_ms > 0 and c.fp32_ms > 0 and c.samples == 40 * len(_batches(qm))
    assert c.timed_by == ("placement" if qm.qgraph.whole_model_timing is not None else "")


def test_a_model_that_fails_on_the_timing_cut_is_refused_with_the_fix_named():
    """_time_pair's ExportError names the model and what to do (a dim 0 named like a batch that is not one)."""
    from onnx import TensorProto, helper

    from netquant.errors import ExportError
    from netquant.export.fidelity import _time_pair

    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [2, 3])
    graph = helper.make_graph([helper.make_node("Reshape", ["x", "shape"], ["y"])], "needs_two_rows",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [shape])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    assert sess.run(None, {"x": np.ones((2, 3), np.float32)})[0].shape == (2, 3)  # the whole batch runs
    with pytest.raises(ExportError, match=r"(?s)model\.onnx.*timing batch.*dim 0 other than a batch axis"):
        _time_pair(sess, sess, {"x": np.ones((1, 3), np.float32)}, "model.onnx")
