"""TFLite export: files LiteRT runs, int8 tensors with netquant's exact params, NHWC, TFLite's op constraints."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.errors import ExportError
from netquant.export.slots import params_of
from netquant.export.validate import cosine
from netquant.platforms import get_platform
from netquant.platforms.platform import OpRole, OpRule
from tests.conftest import CliInvoke
from tests.helpers.export_models import conv_net, images
from tests.helpers.graph_helpers import ort_run
from tests.helpers.ir import make_model

litert = pytest.importorskip("ai_edge_litert.interpreter")


# ---------------------------------------------------------------------------------------------- helpers
def _model(nodes: list[onnx.NodeProto], inits: dict[str, np.ndarray], in_shape: list[int | str], out: str,
           out_shape: list[int | str], opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "t", [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_shape)],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, out_shape)],
                              [numpy_helper.from_array(v.astype(np.float32) if v.dtype.kind == "f" else v, k)
                               for k, v in inits.items()])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def _run_lite(path: Path, x: np.ndarray) -> np.ndarray:
    """LiteRT outputs for NCHW `x`, one sample at a time (the file takes NHWC, batch 1)."""
    it = litert.Interpreter(model_path=str(path), num_threads=1)
    it.allocate_tensors()
    d_in, d_out = it.get_input_details()[0], it.get_output_details()[0]
    ys = []
    for k in range(len(x)):
        xk = x[k:k + 1]
        it.set_tensor(d_in["index"], np.ascontiguousarray(xk.transpose(0, 2, 3, 1) if xk.ndim == 4 else xk))
        it.invoke()
        ys.append(it.get_tensor(d_out["index"]).copy())
    return np.concatenate(ys)


def _details(path: Path) -> dict[str, dict]:
    it = litert.Interpreter(model_path=str(path))
    return {d["name"]: d for d in it.get_tensor_details()}


def _export(model: onnx.ModelProto, x: np.ndarray, tmp_path: Path, platform: object = "tflite_int8",
            **kw: object) -> tuple[netquant.QuantizedModel, Path, object]:
    qm = netquant.quantize_onnx(model, [{"x": x[i:i + 4]} for i in range(0, len(x), 4)], platform=platform,
                                quiet=True, **kw)
    path = tmp_path / "m.tflite"
    report = qm.export(path)
    return qm, path, report


def _close_to_fp32(model: onnx.ModelProto, path: Path, x: np.ndarray, min_cos: float = 0.995) -> np.ndarray:
    ref = ort_run(model, {"x": x})[0]
    got = _run_lite(path, x)
    assert got.shape == ref.shape
    assert cosine(got, ref) >= min_cos
    return got


def _rng_x(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _with_int8_elementwise() -> object:
    """tflite_int8 also running Add / Mul / Softmax / Concat in int8 (the converter's int8 element-wise path)."""
    p = get_platform("tflite_int8")
    rules = dict(p.rules)
    rules.update({t: OpRule(t, OpRole.ARITHMETIC, (0, 1)) for t in ("Add", "Mul")})
    rules["Concat"] = OpRule("Concat", OpRole.SHARED_SCALE, None)
    rules["Softmax"] = OpRule("Softmax", OpRole.ARITHMETIC)
    return p.with_(name="tflite_full_int8", rules=rules)


# ---------------------------------------------------------------------------------------------- models
def test_conv_relu_pool_gemm_runs_in_litert_with_int8_ops_and_matches_onnxruntime(tmp_path: Path) -> None:
    model = conv_net(batch="N", channels=16)  # 432 multiply-adds per pixel: conv1 int8 too
    x = images(16)
    _, path, report = _export(model, x, tmp_path)
    assert report.validated and "LiteRT" in report.validated_with
    kernels = report.int8_kernels or {}
    assert kernels.get("CONV_2D") == 2 and kernels.get("FULLY_CONNECTED") == 1  # (MaxPool after a float Add: float)
    assert report.input_shapes == {"x": (1, 16, 16, 3)}  # NHWC, batch 1
    _close_to_fp32(model, path, x)


def test_int8_tensors_carry_netquants_scales_and_tflite_weight_bias_rules(tmp_path: Path) -> None:
    model = conv_net(batch="N", channels=16)
    qm, path, _ = _export(model, images(16), tmp_path)
    details = _details(path)
    qg = qm.qgraph
    checked = 0
    for node in qg.graph.nodes:
        oc = qg.op_configs.get(node.name)
        if oc is None or node.op_type != "Conv" or oc.outputs[0] is None or not oc.outputs[0].is_active:
            continue
        # the conv's output tensor (its fused Relu's, when fused) carries netquant's scale / zero point exactly
        tail = [n for n in qg.graph.nodes if n.inputs and n.inputs[0] == node.outputs[0] and n.op_type == "Relu"]
        name = tail[0].outputs[0] if tail else node.outputs[0]
        scale, zp, _ = params_of(oc.outputs[0])
        d = details[name]
        assert d["dtype"] == np.int8
        assert d["quantization_parameters"]["scales"][0] == np.float32(scale)
        assert d["quantization_parameters"]["zero_points"][0] == int(zp)
        # weights: OHWI int8 in [-127, 127], zero point 0, per output channel (dimension 0)
        w = details[node.inputs[1]]
        wq = w["quantization_parameters"]
        assert w["dtype"] == np.int8 and tuple(w["shape"]) == (16, 3, 3, qg.graph.initializers[node.inputs[1]].shape[1])
        assert (wq["zero_points"] == 0).all() and wq["quantized_dimension"] == 0 and len(wq["scales"]) == 16
        it = litert.Interpreter(model_path=str(path))
        codes = it.get_tensor(w["index"])
        assert codes.min() >= -127 and codes.max() <= 127
        w_scale, _, _ = params_of(oc.inputs[1])
        np.testing.assert_array_equal(wq["scales"], w_scale.numpy().astype(np.float32))
        # bias: int32 with scale = input scale * weight scale
        in_scale = float(params_of(oc.inputs[0])[0])
        b = details[f"{node.name}_bias"]
        assert b["dtype"] == np.int32
        np.testing.assert_allclose(b["quantization_parameters"]["scales"], in_scale * wq["scales"], rtol=1e-6)
        checked += 1
    assert checked == 2


def test_depthwise_conv_writes_1hwo_weights_per_channel_on_dimension_3(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    inits = {"w1": rng.standard_normal((16, 3, 3, 3)) * 0.3, "b1": rng.standard_normal(16) * 0.1,
             "wd": rng.standard_normal((16, 1, 3, 3)) * 0.3, "bd": rng.standard_normal(16) * 0.1}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu"),
             helper.make_node("Conv", ["r1", "wd", "bd"], ["y"], group=16, pads=[1, 1, 1, 1], strides=[2, 2],
                              name="dw")]
    model = _model(nodes, inits, ["N", 3, 12, 12], "y", ["N", 16, 6, 6])
    x = _rng_x((8, 3, 12, 12))
    _, path, report = _export(model, x, tmp_path)
    assert (report.int8_kernels or {}).get("DEPTHWISE_CONV_2D") == 1
    w = _details(path)["wd"]
    assert tuple(w["shape"]) == (1, 3, 3, 16) and w["quantization_parameters"]["quantized_dimension"] == 3
    got = _close_to_fp32(model, path, x)
    assert got.shape == (8, 16, 6, 6)  # 4-D output back in the ONNX model's NCHW layout


def test_add_mul_int8_and_float_paths_agree_with_onnxruntime(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    inits = {"w1": rng.standard_normal((8, 3, 3, 3)) * 0.3, "w2": rng.standard_normal((8, 3, 1, 1)) * 0.3,
             "s": rng.random((8, 1, 1)) + 0.5, "c": np.array([0.25])}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1], name="c1"),
             helper.make_node("Conv", ["x", "w2"], ["b"], name="c2"),
             helper.make_node("Add", ["a", "b"], ["s1"], name="add"),
             helper.make_node("Mul", ["s1", "s"], ["m"], name="mul_channel"),  # (C,1,1) broadcast -> NHWC
             helper.make_node("Add", ["m", "c"], ["y"], name="add_scalar")]
    model = _model(nodes, inits, ["N", 3, 10, 10], "y", ["N", 8, 10, 10])
    x = _rng_x((8, 3, 10, 10), 3)
    _, path, report = _export(model, x, tmp_path)  # tflite_int8: Add / Mul in float between int8 convs
    assert "ADD" not in (report.int8_kernels or {}) and report.dequantize_nodes >= 1
    _close_to_fp32(model, path, x)
    (tmp_path / "int8").mkdir()
    _, path8, report8 = _export(model, x, tmp_path / "int8", platform=_with_int8_elementwise())
    assert (report8.int8_kernels or {}).get("ADD") == 2 and (report8.int8_kernels or {}).get("MUL") == 1
    _close_to_fp32(model, path8, x, min_cos=0.99)


def test_concat_on_channels_maps_to_nhwc_axis_with_one_shared_scale(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    inits = {"w1": rng.standard_normal((8, 3, 3, 3)) * 0.3, "w2": rng.standard_normal((4, 3, 3, 3)),
             "w3": rng.standard_normal((6, 12, 1, 1)) * 0.3}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["a"], pads=[1, 1, 1, 1], name="c1"),
             helper.make_node("Conv", ["x", "w2"], ["b"], pads=[1, 1, 1, 1], name="c2"),
             helper.make_node("Concat", ["a", "b"], ["cat"], axis=1, name="cat"),
             helper.make_node("Conv", ["cat", "w3"], ["y"], name="c3")]
    model = _model(nodes, inits, ["N", 3, 8, 8], "y", ["N", 6, 8, 8])
    x = _rng_x((8, 3, 8, 8), 5)
    _, path, report = _export(model, x, tmp_path)
    assert (report.int8_kernels or {}).get("CONCATENATION") == 1
    d = _details(path)
    qa, qb, qc = (d[n]["quantization_parameters"] for n in ("a", "b", "cat"))
    assert qa["scales"][0] == qb["scales"][0] == qc["scales"][0]
    assert qa["zero_points"][0] == qb["zero_points"][0] == qc["zero_points"][0]
    _close_to_fp32(model, path, x)


def test_quantized_softmax_as_last_op_has_tflites_fixed_output_params(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    inits = {"w": rng.standard_normal((16, 10)) * 0.5, "b": rng.standard_normal(10) * 0.1}
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["g"], name="fc"),
             helper.make_node("Softmax", ["g"], ["y"], axis=-1, name="softmax")]
    model = _model(nodes, inits, ["N", 16], "y", ["N", 10])
    x = _rng_x((16, 16), 7)
    qm, path, report = _export(model, x, tmp_path)
    assert (report.int8_kernels or {}).get("SOFTMAX") == 1
    scale, zp, _ = params_of(qm.qgraph.op_configs["softmax"].outputs[0])  # the platform fixes it too
    assert (float(scale), int(zp)) == (1 / 256, -128)
    details = _details(path)
    assert details["y"]["dtype"] == np.float32  # the model output: float, after a DEQUANTIZE
    sm = details["y_int8"]  # SOFTMAX's own output
    assert sm["dtype"] == np.int8 and sm["quantization_parameters"]["scales"][0] == np.float32(1 / 256)
    assert sm["quantization_parameters"]["zero_points"][0] == -128
    got = _close_to_fp32(model, path, x, min_cos=0.999)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, atol=0.05)


def test_reshape_and_transpose_across_the_nchw_nhwc_boundary(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    inits = {"w1": rng.standard_normal((8, 3, 3, 3)) * 0.3, "wm": rng.standard_normal((8, 5)) * 0.3,
             "shape_i": np.array([0, 8, -1], dtype=np.int64)}
    nodes = [helper.make_node("Conv", ["x", "w1"], ["c"], pads=[1, 1, 1, 1], name="conv"),
             helper.make_node("Relu", ["c"], ["r"], name="relu"),
             helper.make_node("Reshape", ["r", "shape_i"], ["flat"], name="reshape"),  # (N, 8, H*W): NCHW order
             helper.make_node("Transpose", ["flat"], ["t"], perm=[0, 2, 1], name="transpose"),
             helper.make_node("MatMul", ["t", "wm"], ["y"], name="matmul")]
    model = _model(nodes, inits, ["N", 3, 6, 10], "y", ["N", 60, 5])
    x = _rng_x((8, 3, 6, 10), 9)
    _, path, report = _export(model, x, tmp_path)
    kernels = report.int8_kernels or {}
    assert kernels.get("RESHAPE") == 1 and kernels.get("FULLY_CONNECTED") == 1
    _close_to_fp32(model, path, x)


# ---------------------------------------------------------------------------------------------- errors / CLI
def test_dynamic_shapes_without_a_sample_give_a_clear_export_error(tmp_path: Path) -> None:
    model = conv_net(batch="N")
    qm = netquant.quantize_onnx(model, {"x": images(8)}, platform="tflite_int8", quiet=True,
                                force_fp32=("glob:*",), allow_float=True)  # nothing calibrated: no batches kept
    dyn = _model([helper.make_node("Relu", ["x"], ["y"])], {}, ["N", 3, "H", "W"], "y", ["N", 3, "H", "W"])
    qd = netquant.quantize_onnx(dyn, {"x": images(8)}, platform="tflite_int8", quiet=True, allow_float=True)
    with pytest.raises(ExportError, match="sample"):
        qd.export(tmp_path / "d.tflite")
    assert not (tmp_path / "d.tflite").exists()
    report = qm.export(tmp_path / "f.tflite", sample=images(2))  # an FP32 .tflite with the same writer
    assert not report.int8_kernels
    _close_to_fp32(model, tmp_path / "f.tflite", images(4), min_cos=0.99999)


def test_uint8_platforms_are_refused_and_missing_litert_names_the_extra(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = conv_net(batch="N")
    qm = netquant.quantize_onnx(model, {"x": images(8)}, platform="onnxruntime_int8", quiet=True)
    with pytest.raises(ExportError, match="tflite_int8"):
        qm.export(tmp_path / "u.tflite")
    qt = netquant.quantize_onnx(model, {"x": images(8)}, platform="tflite_int8", quiet=True)
    monkeypatch.setitem(sys.modules, "ai_edge_litert", None)
    with pytest.raises(ExportError, match=r"netquant\[tflite\]"):
        qt.export(tmp_path / "t.tflite")
    assert not list(tmp_path.glob("*.tflite"))


def test_cli_writes_a_tflite_file_litert_runs(run_cli: CliInvoke, conv_net_file: Path, calib_npy: Path,
                                               tmp_path: Path) -> None:
    out = tmp_path / "net.tflite"
    result = run_cli("quantize", conv_net_file, "--platform", "tflite_int8", "--calib", calib_npy, "-o", out)
    assert result.exit_code == 0, result.output
    assert "LiteRT" in result.output and "CONV_2D" in result.output
    x = images(4, seed=5)[:1]
    _close_to_fp32(onnx.load(conv_net_file), out, x)


# ---------------------------------------------------------------------------------------------- PP-OCR
def _ocr_sets(which: str, n_calib: int, n_eval: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | list[str]]:
    from netquant.data.ocr import cls_batch, direction_samples, rec_batch
    from netquant.data.text_render import make_text_lines

    calib, evals = make_text_lines(n_calib, seed=1000), make_text_lines(n_eval, seed=2000)
    if which == "rec":
        return rec_batch(calib), rec_batch(evals), [line.text for line in evals]
    d = direction_samples(evals)
    return (cls_batch([s.image for s in direction_samples(calib)]), cls_batch([s.image for s in d]),
            np.array([s.label for s in d]))


def _ocr_accuracy(which: str, n_calib: int, n_eval: int, tmp_path: Path) -> tuple[float, float]:
    from netquant.api import zoo
    from netquant.data.ocr import ctc_greedy_decode, score_lines

    xc, xe, truth = _ocr_sets(which, n_calib, n_eval)
    model = str(zoo.ppocr_model_path(which))
    qm = netquant.quantize_onnx(model, [{"x": xc[i:i + 8]} for i in range(0, len(xc), 8)],
                                platform="tflite_int8", quiet=True)
    path = tmp_path / f"{which}.tflite"
    qm.export(path)
    lite = _run_lite(path, xe)
    fp32 = np.concatenate([ort_run(model, {"x": xe[i:i + 16]})[0] for i in range(0, len(xe), 16)])

    def score(y: np.ndarray) -> float:
        if which == "rec":
            return score_lines(ctc_greedy_decode(y, zoo.ppocr_rec_dictionary()), truth).line_acc
        return float((y.argmax(1) == truth).mean())

    return score(lite), score(fp32)


def test_ppocr_classifier_in_litert_matches_fp32(tmp_path: Path) -> None:
    lite, fp32 = _ocr_accuracy("cls", 32, 64, tmp_path)
    assert lite >= fp32 - 1 / 64


@pytest.mark.slow
@pytest.mark.parametrize("which", ["cls", "rec"])
def test_ppocr_within_one_point_of_fp32_in_litert(which: str, tmp_path: Path) -> None:
    lite, fp32 = _ocr_accuracy(which, 64, 400, tmp_path)
    assert lite >= fp32 - 0.01
