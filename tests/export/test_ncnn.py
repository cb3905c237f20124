"""ncnn export: int8 .param/.bin that ncnn itself loads and runs, checked byte by byte against netquant's numbers."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.errors import ExportError
from netquant.export.ncnn import decode, export_ncnn, parse_table, read_param, walk
from netquant.export.ncnn.export import int8_layers_of
from netquant.export.ncnn.modelbin import TAG_INT8
from netquant.export.ncnn.param import parse_param
from netquant.export.slots import params_of
from netquant.export.validate import cosine
from tests.helpers.ir import make_model

ncnn = pytest.importorskip("ncnn")
pytest.importorskip("pnnx")


def small_net(seed: int = 0, pool_output: bool = False) -> onnx.ModelProto:
    """x[N,3,16,16] -> Conv+Relu -> depthwise Conv -> MaxPool -> GAP -> Flatten -> Gemm (pool_output: the MaxPool
    output 'p' is a second model output, listed first)."""
    rng = np.random.default_rng(seed)
    inits = {"w1": rng.standard_normal((8, 3, 3, 3)) * 0.3, "b1": rng.standard_normal(8) * 0.1,
             "wd": rng.standard_normal((8, 1, 3, 3)) * 0.4, "bd": rng.standard_normal(8) * 0.1,
             "wg": rng.standard_normal((10, 8)) * 0.3, "bg": rng.standard_normal(10) * 0.1}
    nodes = [helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], name="conv1", pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
             helper.make_node("Conv", ["r1", "wd", "bd"], ["c2"], name="dwconv", pads=[1, 1, 1, 1], group=8),
             helper.make_node("MaxPool", ["c2"], ["p"], name="pool", kernel_shape=[2, 2], strides=[2, 2]),
             helper.make_node("GlobalAveragePool", ["p"], ["g"], name="gap"),
             helper.make_node("Flatten", ["g"], ["f"], name="flatten"),
             helper.make_node("Gemm", ["f", "wg", "bg"], ["y"], name="fc", transB=1)]
    graph = helper.make_graph(nodes, "small_net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                              ([helper.make_tensor_value_info("p", TensorProto.FLOAT, ["N", 8, 8, 8])] if pool_output
                               else []) + [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 10])],
                              [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def quantized():
    x = np.random.default_rng(1).standard_normal((32, 3, 16, 16)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return netquant.quantize_onnx(small_net(), [x[:16], x[16:]], platform="ncnn_int8", quiet=True)


@pytest.fixture(scope="module")
def exported(quantized, tmp_path_factory):
    out = tmp_path_factory.mktemp("ncnn") / "model.param"
    report = quantized.export(out)
    return quantized, report, out


def _round_half_away(v: np.ndarray) -> np.ndarray:
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def _netquant_numbers(qm, node: str):
    """(weight codes [out, rest], per-channel weight scale, input scale) from netquant's configs, by hand."""
    qgraph = qm.qgraph
    n = qgraph.graph.node(node)
    oc = qgraph.op_configs[node]
    w = qgraph.graph.initializers[n.inputs[1]].numpy().astype(np.float64)
    w_scale = params_of(oc.inputs[1])[0].numpy().astype(np.float64).reshape(-1)
    a_scale = float(params_of(oc.inputs[0])[0])
    shape = [-1] + [1] * (w.ndim - 1)
    codes = np.clip(_round_half_away(w / w_scale.reshape(shape)), -127, 127).astype(np.int8)
    return codes.reshape(codes.shape[0], -1), w_scale, a_scale


def test_ncnn_export_writes_int8_layers_with_netquants_weights_and_scales(exported):
    qm, report, out = exported
    param = read_param(out)
    data = out.with_suffix(".bin").read_bytes()
    assert report.int8_layers == {"Convolution": 1, "ConvolutionDepthWise": 1, "InnerProduct": 1}
    assert sorted(report.int8_layer_ops.values()) == ["conv1", "dwconv", "fc"]
    assert sorted(int8_layers_of(param)) == sorted(report.int8_layer_ops)
    segments = {(s.layer, s.name): s for s in walk(param, data)}  # covers the file exactly
    for layer_name, node in report.int8_layer_ops.items():
        layer = param.layer(layer_name)
        assert layer.int_param(8) == (1 if layer.type == "ConvolutionDepthWise" else 2)
        weight = segments[(layer_name, "weight")]
        assert int.from_bytes(data[weight.offset:weight.offset + 4], "little") == TAG_INT8
        codes, w_scale, a_scale = _netquant_numbers(qm, node)
        np.testing.assert_array_equal(decode(weight, data), codes.reshape(-1))
        np.testing.assert_array_equal(decode(segments[(layer_name, "weight_scales")], data),
                                      (1.0 / w_scale).astype(np.float32))
        np.testing.assert_array_equal(decode(segments[(layer_name, "bottom_scales")], data),
                                      np.array([1.0 / a_scale], dtype=np.float32))


def test_ncnn_table_decodes_to_netquants_scales(exported):
    qm, report, out = exported
    weights, blobs = parse_table(out.with_suffix(".table").read_text())
    assert set(weights) == set(blobs) == set(report.int8_layer_ops)
    for layer_name, node in report.int8_layer_ops.items():
        _, w_scale, a_scale = _netquant_numbers(qm, node)
        np.testing.assert_array_equal(weights[layer_name], (1.0 / w_scale).astype(np.float32))
        np.testing.assert_array_equal(blobs[layer_name], np.array([1.0 / a_scale], dtype=np.float32))


def _ncnn_run(param: Path, x: np.ndarray, int8: bool) -> np.ndarray:
    net = ncnn.Net()
    net.opt.use_int8_inference = int8
    net.opt.use_fp16_storage = net.opt.use_fp16_packed = net.opt.use_fp16_arithmetic = False
    net.opt.num_threads = 1
    assert net.load_param(str(param)) == 0
    net.load_model(str(param.with_suffix(".bin")))
    outs = []
    for sample in x:
        with net.create_extractor() as ex:
            ex.input("x", ncnn.Mat(np.ascontiguousarray(sample)).clone())
            ret, y = ex.extract("y")
            assert ret == 0
            outs.append(np.array(y).reshape(-1))
    return np.stack(outs)


def test_ncnn_runs_the_int8_model_as_netquants_fake_quant(exported):
    qm, report, out = exported
    x = np.random.default_rng(7).standard_normal((8, 3, 16, 16)).astype(np.float32)
    got = _ncnn_run(out, x, int8=True)
    with torch.no_grad():
        fq = qm.run({"x": torch.from_numpy(x)})["y"].numpy()
        fp = qm.run({"x": torch.from_numpy(x)}, fake_quant=False)["y"].numpy()
    assert cosine(got, fq) > 0.9995  # ncnn computes what netquant simulates
    assert cosine(got, fp) >= cosine(fq, fp) - 0.002  # and is as close to FP32
    assert 0.99 < cosine(got, fp) < 1.0  # really quantized
    assert report.validated and report.validation_samples == 32  # both batches: 16 < VALIDATION_SAMPLES after the first
    assert report.conversion_cosine["y"] > 0.99999  # pnnx's FP32 model is the source model
    assert report.blob_names == {"x": "x", "y": "y"}


def test_ncnn_export_refuses_a_model_ncnn_computes_wrongly(quantized, tmp_path, monkeypatch):
    from netquant.export.ncnn import export as ncnn_export

    real = ncnn_export.plan_int8

    def wrong_scales(*args, **kwargs):
        plan = real(*args, **kwargs)
        for layer in plan.layers:
            layer.bottom_scale = np.float32(layer.bottom_scale * 8)  # inputs saturate in ncnn
        return plan

    monkeypatch.setattr(ncnn_export, "plan_int8", wrong_scales)
    out = tmp_path / "bad.param"
    with pytest.raises(ExportError, match="disagrees with netquant's fake-quant"):
        export_ncnn(quantized, out)
    assert sorted(tmp_path.iterdir()) == []  # nothing written


def test_ncnn_export_without_the_engine_says_what_to_install(quantized, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pnnx", None)
    with pytest.raises(ExportError, match=r"pip install netquant\[ncnn\]"):
        export_ncnn(quantized, tmp_path / "m.param")
    assert list(tmp_path.iterdir()) == []


def test_param_text_round_trips(exported):
    _, _, out = exported
    text = out.read_text()
    param = parse_param(text)
    assert parse_param(param.text()) == param
    assert [ln.split() for ln in param.text().splitlines()] == [ln.split() for ln in text.splitlines()]


@pytest.mark.slow
def test_ppocr_classifier_in_ncnn_int8_within_one_point(tmp_path):
    from netquant.api import zoo
    from netquant.data.ocr import cls_batch, direction_samples
    from netquant.data.text_render import make_text_lines

    calib = cls_batch([s.image for s in direction_samples(make_text_lines(64, seed=1000))])
    held_out = direction_samples(make_text_lines(200, seed=2000))
    x = cls_batch([s.image for s in held_out])
    labels = np.array([s.label for s in held_out])
    qm = netquant.quantize_onnx(str(zoo.ppocr_model_path("cls")), [calib[i:i + 16] for i in range(0, 64, 16)],
                                platform="ncnn_int8", quiet=True)
    out = tmp_path / "cls.param"
    report = qm.export(out)
    assert report.int8_layers == {"Convolution": 24, "ConvolutionDepthWise": 11, "InnerProduct": 19}
    assert not report.float_heavy_layers
    int8 = (_ncnn_run_named(out, x, report, int8=True).argmax(1) == labels).mean()
    with torch.no_grad():
        fp = qm.run({"x": torch.from_numpy(x)}, fake_quant=False)[qm.graph.output_names[0]].numpy()
    fp32 = (fp.argmax(1) == labels).mean()
    assert int8 >= fp32 - 0.01


def _ncnn_run_named(param: Path, x: np.ndarray, report, int8: bool) -> np.ndarray:
    from netquant.export.ncnn.runner import NcnnRunner

    runner = NcnnRunner(param, param.with_suffix(".bin"), int8=int8)
    name_in, name_out = report.blob_names["x"], next(v for k, v in report.blob_names.items() if k != "x")
    return runner.run_batch({"x": x}, [name_in], [name_out])[0]


def test_cli_dash_o_param_writes_the_ncnn_model_bin_and_table(run_cli, tmp_path):
    model, calib = tmp_path / "net.onnx", tmp_path / "calib.npy"
    onnx.save(small_net(), model)
    np.save(calib, np.random.default_rng(1).standard_normal((16, 3, 16, 16)).astype(np.float32))
    out = tmp_path / "net_int8.param"
    result = run_cli("quantize", model, "--platform", "ncnn_int8", "--calib", calib, "-o", out)
    assert result.exit_code == 0, result.output
    assert "int8 kernels in ncnn" in result.output and "ConvolutionDepthWise x1" in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["calib.npy", "net.onnx", "net_int8.bin", "net_int8.param",
                                                          "net_int8.table"]
    assert len(int8_layers_of(read_param(out))) == 3
    weights, _ = parse_table(out.with_suffix(".table").read_text())
    assert len(weights) == 3


def test_ncnn_export_keeps_the_order_of_several_outputs(tmp_path):
    x = np.random.default_rng(1).standard_normal((16, 3, 16, 16)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_onnx(small_net(pool_output=True), [x], platform="ncnn_int8", quiet=True)
    report = export_ncnn(qm, tmp_path / "two.param")
    assert report.blob_names == {"x": "x", "p": "p", "y": "y"}
    assert set(report.output_cosine) == {"p", "y"} and min(report.output_cosine.values()) > 0.999
    net = ncnn.Net()
    assert net.load_param(str(tmp_path / "two.param")) == 0
    assert sorted(net.output_names()) == ["p", "y"]


@pytest.mark.slow
def test_ppocr_recognizer_in_ncnn_int8_within_one_point(tmp_path):
    from netquant.api import zoo
    from netquant.data.ocr import ctc_greedy_decode, rec_batch, score_lines
    from netquant.data.text_render import make_text_lines

    dictionary = zoo.ppocr_rec_dictionary()
    calib = rec_batch(make_text_lines(64, seed=1000))
    lines = make_text_lines(100, seed=2000)
    x = rec_batch(lines)
    qm = netquant.quantize_onnx(str(zoo.ppocr_model_path("rec")), [calib[i:i + 8] for i in range(0, 64, 8)],
                                platform="ncnn_int8", quiet=True)
    out = tmp_path / "rec.param"
    report = qm.export(out)
    assert report.int8_layers == {"Convolution": 20, "ConvolutionDepthWise": 14, "InnerProduct": 4}
    truth = [line.text for line in lines]
    int8 = _ncnn_run_named(out, x, report, int8=True).reshape(len(x), -1, len(dictionary))
    with torch.no_grad():
        fp = np.concatenate([qm.run({"x": torch.from_numpy(x[i:i + 25])}, fake_quant=False)[qm.graph.output_names[0]]
                             .numpy() for i in range(0, len(x), 25)])
    acc8 = score_lines(ctc_greedy_decode(int8, dictionary), truth).line_acc
    acc32 = score_lines(ctc_greedy_decode(fp, dictionary), truth).line_acc
    assert acc8 >= acc32 - 0.01


def test_ncnn_export_is_deterministic_and_writes_the_fp32_model_the_table_names(quantized, tmp_path):
    a = export_ncnn(quantized, tmp_path / "a.param", fp32_path=tmp_path / "fp32.param")
    export_ncnn(quantized, tmp_path / "b.param")
    for suffix in (".param", ".bin", ".table"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()
    fp32 = read_param(tmp_path / "fp32.param")
    assert int8_layers_of(fp32) == []
    assert [la.name for la in fp32.layers] == [la.name for la in read_param(tmp_path / "a.param").layers]
    weights, _ = parse_table((tmp_path / "a.table").read_text())
    assert set(weights) == set(a.int8_layer_ops) <= {la.name for la in fp32.layers}
    x = np.random.default_rng(3).standard_normal((2, 3, 16, 16)).astype(np.float32)
    with torch.no_grad():
        fp = quantized.run({"x": torch.from_numpy(x)}, fake_quant=False)["y"].numpy()
    np.testing.assert_allclose(_ncnn_run(tmp_path / "fp32.param", x, int8=False), fp, rtol=1e-4, atol=1e-5)


def test_ncnn_export_of_an_ir14_model_lowers_the_ir_for_pnnx(tmp_path):
    """onnx >= 1.20 writes IR 14, which crashes pnnx's bundled onnxruntime: the converter gets the opsets' IR."""
    from netquant.export.ncnn.pnnx_convert import ir_version_for_pnnx

    model = small_net()
    model.ir_version = 14
    assert ir_version_for_pnnx(model) == 7  # opset 13 needs IR 7
    x = np.random.default_rng(2).standard_normal((16, 3, 16, 16)).astype(np.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qm = netquant.quantize_onnx(model, [x], platform="ncnn_int8", quiet=True)
    report = export_ncnn(qm, tmp_path / "ir14.param")
    assert min(report.output_cosine.values()) > 0.999
