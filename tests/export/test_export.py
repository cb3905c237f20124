"""Export: ONNX QDQ files checked against onnxruntime and netquant's own fake-quant executor."""

from __future__ import annotations

import json
import struct
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import numpy_helper

import netquant
from netquant.core.tensor_config import QuantState
from netquant.errors import ExportError
from netquant.export import (
    export_qdq,
    export_quant_params_json,
    export_trt_calibration_cache,
    ort_int8_kernels,
    scale_hex,
    trt_scales,
)
from netquant.export.opset import ai_onnx_opset
from netquant.export.validate import cosine
from netquant.platforms import list_platforms
from tests.helpers.export_models import conv_net, gemm_softmax, images, mlp


def _session(path: Path) -> ort.InferenceSession:
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def _quantize(model: onnx.ModelProto, x: np.ndarray, platform: str = "onnxruntime_int8"):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return netquant.quantize_onnx(model, {"x": x}, platform=platform, quiet=True)


# ---- the real text-direction classifier (PP-OCR, opset 11, weights in Constant nodes) ------------

@pytest.fixture(scope="module")
def cls_export(tmp_path_factory: pytest.TempPathFactory):
    from netquant.api import zoo
    from netquant.data.ocr import cls_batch, direction_samples
    from netquant.data.text_render import make_text_lines

    calib = cls_batch([s.image for s in direction_samples(make_text_lines(32, seed=11))])
    test = cls_batch([s.image for s in direction_samples(make_text_lines(24, seed=12))])
    qm = netquant.quantize_onnx(str(zoo.ppocr_model_path("cls")), {"x": calib}, quiet=True)
    path = tmp_path_factory.mktemp("cls") / "cls_int8.onnx"
    report = export_qdq(qm.qgraph, path)
    return qm, report, path, test


def test_classifier_qdq_in_onnxruntime_matches_executor_fake_quant(cls_export) -> None:
    qm, report, path, test = cls_export
    got = _session(path).run(None, {"x": test})[0]
    ref = qm.run({"x": torch.from_numpy(test)}, fake_quant=True)
    ref = next(iter(ref.values())).numpy()
    assert cosine(ref, got) >= 0.999
    assert np.array_equal(ref.argmax(1), got.argmax(1))
    assert report.validated and min(report.output_cosine.values()) >= 0.999


def test_classifier_export_upgrades_opset_and_stores_integer_weights(cls_export) -> None:
    qm, report, path, _ = cls_export
    model = onnx.load(str(path))
    assert report.source_opset == 11 and report.opset == ai_onnx_opset(model) == 13
    onnx.checker.check_model(model, full_check=True)
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    quantized = set(qm.quantized_ops())
    conv_weights = [producers.get(n.input[1]) for n in model.graph.node if n.op_type == "Conv" and n.name in quantized]
    assert conv_weights and all(p is not None and p.op_type == "DequantizeLinear" for p in conv_weights)
    for dq in conv_weights:
        q = inits[dq.input[0]]
        assert q.dtype == np.int8 and q.ndim == 4
        axis = {a.name: a.i for a in dq.attribute}.get("axis", 1)
        assert axis == 0 and inits[dq.input[1]].shape == (q.shape[0],)  # per output channel
    biases = [producers.get(n.input[2]) for n in model.graph.node
              if n.op_type == "Conv" and n.name in quantized and len(n.input) > 2]
    assert biases and all(inits[p.input[0]].dtype == np.int32 for p in biases)
    # no float copy of a quantized conv weight is left in the file
    conv_weight_names = {n.inputs[1] for n in qm.graph.nodes if n.op_type == "Conv" and n.name in quantized}
    assert conv_weight_names and not conv_weight_names & set(inits)
    # the input keeps its dynamic dims exactly as the original declares them (Paddle's -1 / '?')
    original = onnx.load(str(netquant.api.zoo.ppocr_model_path("cls")), load_external_data=False)
    assert model.graph.input[0].type == original.graph.input[0].type
    assert [d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim] == [-1, 3, 0, 0]


def test_ort_int8_kernels_counts_fused_convs(cls_export) -> None:
    qm, report, path, _ = cls_export
    kernels = ort_int8_kernels(path)
    assert kernels == report.int8_kernels
    convs = sum(1 for n in qm.graph.nodes if n.op_type == "Conv" and n.name in set(qm.quantized_ops()))
    assert convs > 0 and kernels.get("QLinearConv", 0) == convs
    fp32 = ort_int8_kernels(Path(netquant.api.zoo.ppocr_model_path("cls")))
    assert fp32 == {}
    from netquant.export import ort_optimized_op_types

    counts = ort_optimized_op_types(path)
    assert report.runtime_qdq == counts.get("QuantizeLinear", 0) + counts.get("DequantizeLinear", 0)
    n_qdq = sum(n.op_type in ("QuantizeLinear", "DequantizeLinear") for n in onnx.load(str(path)).graph.node)
    assert report.runtime_qdq < n_qdq  # onnxruntime fused most of the file's Q/DQ into integer kernels


# ---- every built-in platform -----------------------------------------------------------------------

@pytest.mark.parametrize("platform", list_platforms())
def test_every_builtin_platform_exports_a_model_onnxruntime_loads(platform: str, tmp_path: Path) -> None:
    x = images(16)
    qm = _quantize(conv_net(), x, platform)
    path = tmp_path / f"{platform}.onnx"
    report = export_qdq(qm.qgraph, path)
    assert report.quantize_nodes + report.dequantize_nodes > 0
    sess = _session(path)
    got = sess.run(None, {"x": images(4, seed=7)})[0]
    ref = qm.run({"x": torch.from_numpy(images(4, seed=7))})["y"].numpy()
    assert cosine(ref, got) >= 0.99


@pytest.mark.parametrize("opset", [11, 13])
@pytest.mark.parametrize("platform", ["tflite_int8", "qnn_dsp"])
def test_quantized_last_op_writing_a_graph_output_exports_a_valid_model(platform: str, opset: int,
                                                                        tmp_path: Path) -> None:
    """Softmax quantized at the graph output; from opset 11 the upgrade rewrites it (Softmax writes
    'y_intermediate', a Reshape writes 'y'): the output Q/DQ must follow the writer, not define 'y' twice."""
    x = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    qm = _quantize(gemm_softmax(opset), x, platform)
    assert "softmax" in qm.quantized_ops()
    path = tmp_path / f"{platform}_{opset}.onnx"
    report = export_qdq(qm.qgraph, path)
    out = onnx.load(str(path))
    onnx.checker.check_model(out, full_check=True)
    writers = [n for n in out.graph.node if "y" in n.output]
    assert len(writers) == 1 and writers[0].op_type == "DequantizeLinear"
    test = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # Q/DQ as defined
    got = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": test})[0]
    ref = qm.run({"x": torch.from_numpy(test)})["y"].numpy()
    assert report.validated and cosine(ref, got) >= 0.9999


def test_quantized_softmax_input_of_an_upgraded_opset11_softmax_is_rewired(tmp_path: Path) -> None:
    """Gemm kept float, Softmax quantized: its input Q/DQ must feed the nodes through which the opset 13 Softmax
    reads it after the upgrade (Shape / Flatten), not fail on the rewritten node."""
    x = np.random.default_rng(0).standard_normal((32, 16)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_onnx(gemm_softmax(11), {"x": x}, platform="qnn_dsp", quiet=True, force_fp32=("Gemm",))
    assert qm.quantized_ops() == ["softmax"]
    path = tmp_path / "softmax_in.onnx"
    report = export_qdq(qm.qgraph, path)
    out = onnx.load(str(path))
    onnx.checker.check_model(out, full_check=True)
    producers = {o: n.op_type for n in out.graph.node for o in n.output}
    softmax = next(n for n in out.graph.node if n.op_type == "Softmax")
    upstream = softmax.input[0]
    while producers.get(upstream) not in ("DequantizeLinear", None):  # through the upgrade's Flatten
        upstream = next(n for n in out.graph.node if upstream in n.output).input[0]
    assert producers.get(upstream) == "DequantizeLinear"
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    test = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    got = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"]).run(None, {"x": test})[0]
    ref = qm.run({"x": torch.from_numpy(test)})["y"].numpy()
    assert report.validated and cosine(ref, got) >= 0.9999


def test_opset11_model_with_per_channel_weights_exports_valid_model(tmp_path: Path) -> None:
    model = conv_net(opset=11, weights_as_constants=True)
    qm = _quantize(model, images(16))
    path = tmp_path / "op11.onnx"
    report = export_qdq(qm.qgraph, path)
    out = onnx.load(str(path))
    onnx.checker.check_model(out, full_check=True)
    assert report.opset_upgraded and ai_onnx_opset(out) >= 13
    axes = [{a.name: a.i for a in n.attribute}.get("axis") for n in out.graph.node
            if n.op_type == "DequantizeLinear" and numpy_helper.to_array(
                next(t for t in out.graph.initializer if t.name == n.input[1])).ndim == 1]
    assert axes and all(a is not None for a in axes)
    got = _session(path).run(None, {"x": images(2, seed=3)})[0]
    fp32 = _session_bytes(model).run(None, {"x": images(2, seed=3)})[0]
    assert cosine(fp32, got) > 0.99


def _session_bytes(model: onnx.ModelProto) -> ort.InferenceSession:
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_integer_weights_shrink_the_file_about_4x(tmp_path: Path) -> None:
    model = mlp()
    x = np.random.default_rng(0).standard_normal((32, 256)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_onnx(model, {"x": x}, quiet=True, objective=None)  # the rules: every MatMul in INT8
    report = export_qdq(qm.qgraph, tmp_path / "mlp.onnx")
    assert report.compression >= 3.5
    assert report.size_bytes == (tmp_path / "mlp.onnx").stat().st_size
    assert report.int8_kernels  # onnxruntime runs the weight matmuls on integers
    dims = onnx.load(str(tmp_path / "mlp.onnx")).graph.input[0].type.tensor_type.shape.dim
    assert dims[0].dim_param == "N"


# ---- failures write nothing --------------------------------------------------------------------------

def test_failed_validation_leaves_no_file_and_keeps_an_existing_one(tmp_path: Path) -> None:
    qm = _quantize(conv_net(), images(16))
    path = tmp_path / "model.onnx"
    with pytest.raises(ExportError, match="disagrees"):
        export_qdq(qm.qgraph, path, min_cosine=1.5, max_error_ratio=None)  # impossible agreement: fails
    assert list(tmp_path.iterdir()) == []
    path.write_bytes(b"previous")
    with pytest.raises(ExportError):
        export_qdq(qm.qgraph, path, opset=12)  # per-axis QDQ needs opset 13
    assert path.read_bytes() == b"previous" and sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx"]


def test_uncalibrated_config_is_an_export_error_naming_it(tmp_path: Path) -> None:
    qm = _quantize(conv_net(), images(16))
    cfg = next(c for c in qm.qgraph.op_configs["conv2"].inputs if c is not None)
    cfg.state = QuantState.INITIAL
    with pytest.raises(ExportError, match="conv2"):
        export_qdq(qm.qgraph, tmp_path / "m.onnx")
    assert not (tmp_path / "m.onnx").exists()


def test_missing_output_folder_is_an_export_error(tmp_path: Path) -> None:
    qm = _quantize(conv_net(), images(16))
    with pytest.raises(ExportError, match="does not exist"):
        export_qdq(qm.qgraph, tmp_path / "nope" / "m.onnx")


# ---- params JSON and TensorRT cache -------------------------------------------------------------------

def test_scale_hex_is_ieee754_float32_bits() -> None:
    assert scale_hex(1.0) == "3f800000"
    assert scale_hex(0.5) == "3f000000"
    assert scale_hex(1 / 127) == "3c010204"
    assert struct.unpack(">f", bytes.fromhex(scale_hex(0.0123)))[0] == pytest.approx(0.0123, rel=1e-7)


def test_tensorrt_cache_holds_amax_over_127_of_each_activation(tmp_path: Path) -> None:
    qm = _quantize(conv_net(), images(16), "tensorrt_int8")
    path = export_trt_calibration_cache(qm.qgraph, tmp_path / "calib.cache")
    lines = path.read_text().splitlines()
    assert lines[0] == "TRT-8601-EntropyCalibration2"
    parsed = {}
    for line in lines[1:]:
        name, hexval = line.rsplit(": ", 1)
        assert len(hexval) == 8
        parsed[name] = struct.unpack(">f", bytes.fromhex(hexval))[0]
    assert "x" in parsed  # the network input is quantized on TensorRT
    # TensorRT's int8 is symmetric: the cache scale equals the symmetric params' scale
    for slot_cfg in (c for oc in qm.qgraph.op_configs.values() for c in oc.inputs
                     if c is not None and c.state is QuantState.ACTIVATED and c.name == "x"):
        assert parsed["x"] == pytest.approx(float(slot_cfg.effective_params.scale), rel=1e-6)
    assert parsed == pytest.approx(trt_scales(qm.qgraph), rel=1e-7)
    # independently of trt_scales: one entry per activation with its own quantizer (ACTIVATED, or PASSIVE
    # like MaxPool's output, which reuses its input's params), holding that config's scale, which is
    # amax / 127 for TensorRT's symmetric narrow int8 (zero point 0, range +-127 s)
    expected: dict[str, set[float]] = {}
    for oc in qm.qgraph.op_configs.values():
        for cfg, tensor in [*zip(oc.inputs, oc.op.inputs), *zip(oc.outputs, oc.op.outputs)]:
            if cfg is None or cfg.state not in (QuantState.ACTIVATED, QuantState.PASSIVE) \
                    or tensor in qm.qgraph.graph.initializers:
                continue
            p = cfg.effective_params
            assert int(p.zero_point) == 0 and (cfg.spec.qmin, cfg.spec.qmax) == (-127, 127)
            expected.setdefault(tensor, set()).add(float(p.scale))
    assert set(parsed) == set(expected) and "x" in parsed
    for tensor, scale in parsed.items():
        assert len(expected[tensor]) == 1 and scale == pytest.approx(expected[tensor].pop(), rel=1e-7), tensor


def test_quant_params_json_records_every_config(tmp_path: Path) -> None:
    qm = _quantize(conv_net(), images(16))
    path = export_quant_params_json(qm.qgraph, tmp_path / "params.json")
    data = json.loads(path.read_text())
    assert data["platform"] == "onnxruntime_int8"
    n_configs = sum(1 for _ in qm.qgraph.configs())
    assert len(data["configs"]) == n_configs
    weights = [r for r in data["configs"] if r["node"] == "conv2" and r["place"] == "input:1"]
    assert weights and weights[0]["granularity"] == "per_channel" and len(weights[0]["scale"]) == 8
    for rec in data["configs"]:
        if "scale" in rec and not rec["is_constant"] and rec["granularity"] == "per_tensor":
            lo, hi = rec["range"]
            assert lo <= 0 <= hi
            assert hi - lo == pytest.approx(rec["scale"] * (rec["quant_max"] - rec["quant_min"]), rel=1e-5)


def test_opset_upgrade_check_catches_a_changed_output() -> None:
    from netquant.export.opset import check_same_outputs, upgrade_opset

    model = conv_net(opset=11)
    feeds = {"x": images(2)}
    upgraded = upgrade_opset(model, 13)
    assert ai_onnx_opset(upgraded) == 13
    check_same_outputs(model, upgraded, feeds, "upgrade")  # the converter keeps outputs
    broken = onnx.ModelProto()
    broken.CopyFrom(upgraded)
    bias = next(t for t in broken.graph.initializer if t.name == "bg")
    bias.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(bias) + 1.0, "bg"))
    with pytest.raises(ExportError, match="changed output 'y'"):
        check_same_outputs(model, broken, feeds, "upgrade")


def test_export_names_a_broken_opset_upgrade_when_validation_fails(tmp_path: Path) -> None:
    """The upgrade is checked against the original only when validation fails: then the error says the upgrade
    changed the output (here the cached upgraded model is sabotaged: its MaxPool averages), and no file is written."""
    from netquant.export import onnx_qdq

    qm = _quantize(conv_net(opset=11), images(16), "onnxruntime_int8")
    base = onnx_qdq._fp32_base(qm.qgraph, 13, None)
    assert base.upgraded and not base.checked
    next(n for n in base.skeleton.graph.node if n.op_type == "MaxPool").op_type = "AveragePool"
    out = tmp_path / "q.onnx"
    with pytest.raises(ExportError, match="upgrading .* changed output 'y'"):
        export_qdq(qm.qgraph, out)
    assert not out.exists()


def test_tensorrt_cache_converts_affine_uint8_params_to_symmetric_amax(tmp_path: Path) -> None:
    qm = _quantize(conv_net(), images(16), "onnxruntime_int8")
    scales = trt_scales(qm.qgraph)
    assert scales
    checked = 0
    for oc in qm.qgraph.op_configs.values():
        for cfg, tensor in zip(oc.outputs, oc.op.outputs):
            if cfg is None or cfg.state is not QuantState.ACTIVATED or tensor not in scales:
                continue
            p = cfg.effective_params
            lo, hi = (0 - float(p.zero_point)) * float(p.scale), (255 - float(p.zero_point)) * float(p.scale)
            assert scales[tensor] == pytest.approx(max(abs(lo), abs(hi)) / 127, rel=1e-6)
            checked += 1
    assert checked > 0


def test_export_is_deterministic(tmp_path: Path) -> None:
    qm = _quantize(conv_net(), images(16))
    a = export_qdq(qm.qgraph, tmp_path / "a.onnx", check_kernels=False)
    b = export_qdq(qm.qgraph, tmp_path / "b.onnx", check_kernels=False)
    assert a.int8_kernels is None and b.size_bytes == a.size_bytes
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()


def test_dynamic_model_without_a_sample_asks_for_one(cls_export, tmp_path: Path) -> None:
    qm, _, _, test = cls_export
    kept, kept_batches = qm.qgraph.sample_inputs, qm.qgraph.validation_batches
    qm.qgraph.sample_inputs, qm.qgraph.validation_batches = None, []
    try:
        with pytest.raises(ExportError, match=r"input 'x'.*pass sample="):
            export_qdq(qm.qgraph, tmp_path / "m.onnx")
        assert not (tmp_path / "m.onnx").exists()
        report = export_qdq(qm.qgraph, tmp_path / "m.onnx", sample={"x": test[:4]}, check_kernels=False)
        assert report.validated and (tmp_path / "m.onnx").exists()
    finally:
        qm.qgraph.sample_inputs, qm.qgraph.validation_batches = kept, kept_batches


def test_model_with_newest_ir_version_exports_a_model_onnxruntime_loads(tmp_path: Path) -> None:
    """onnx.helper.make_model writes the newest IR version, which onnxruntime may not know yet."""
    model = conv_net()
    model.ir_version = onnx.IR_VERSION
    qm = _quantize(model, images(16))
    path = tmp_path / "ir.onnx"
    export_qdq(qm.qgraph, path)
    out = onnx.load(str(path))
    assert out.ir_version == onnx.helper.find_min_ir_version_for(list(out.opset_import), ignore_unknown=True)
    got = _session(path).run(None, {"x": images(2, seed=3)})[0]
    ref = qm.run({"x": torch.from_numpy(images(2, seed=3))})["y"].numpy()
    assert cosine(ref, got) >= 0.99
    # the FP32 reference export compares with is lowered alike (an onnxruntime that refuses the source's IR loads it)
    from netquant.export.fidelity import _cleaned_fp32

    fp32 = _cleaned_fp32(qm.qgraph)
    assert fp32.ir_version == onnx.helper.find_min_ir_version_for(list(fp32.opset_import), ignore_unknown=True) < \
        onnx.IR_VERSION


def test_shared_builds_outlive_other_states_and_the_export_takes_them(tmp_path: Path) -> None:
    """build_qdq_model(share=True) keeps the SHARED_BUILDS latest builds per graph: a build of another state (here
    the DYNAMIC step's) does not drop the kept one, the export of that state takes it (no second build) and writes
    the bytes a fresh build gives; a call without share empties what the graph kept."""
    from netquant.export import onnx_qdq
    from tests.helpers.onnx_models import calib_batches, matmul_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_onnx(matmul_model(), calib_batches((4, 6, 8)), quiet=True, objective=None)
    q = qm.qgraph
    static = onnx_qdq.build_qdq_model(q, share=True)[0]
    assert onnx_qdq.build_qdq_model(q, share=True)[0] is static  # the same state: no second build
    q.dynamic_ops = {"proj"}
    dynamic = onnx_qdq.build_qdq_model(q, share=True)[0]
    assert any(n.op_type == "MatMulInteger" for n in dynamic.graph.node)
    q.dynamic_ops = set()
    built = []
    real_build = onnx_qdq._build
    onnx_qdq._build = lambda *a: built.append(1) or real_build(*a)  # counts the builds the export makes
    try:
        qm.export(tmp_path / "a.onnx")
        assert built == [] and len(onnx_qdq._SHARED.get(q, {})) == 0  # taken, and the kept ones dropped
        qm.export(tmp_path / "b.onnx")
        assert built == [1]
    finally:
        onnx_qdq._build = real_build
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    opsets = (None, 17, 19, 21)[:onnx_qdq.SHARED_BUILDS + 1]
    for opset in opsets:  # the oldest of more than SHARED_BUILDS states (and opsets) is dropped
        onnx_qdq.build_qdq_model(q, opset=opset, share=True)
    assert [key[1] for key in onnx_qdq._SHARED[q]] == list(opsets[1:])
