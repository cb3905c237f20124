"""quantize_onnx / quantize_torch and QuantizedModel: run, evaluate, report, export."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F

import netquant
from netquant.api import ExportKind, QuantizedModel, quantize_onnx, quantize_torch
from netquant.errors import ConfigError, DataError, ModelError
from tests.helpers.exports import json_record, read_params_json, read_trt_cache, symmetric_int8_scale
from tests.helpers.onnx_models import calib_batches, conv_relu_gemm, residual_concat


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def _fq(x: torch.Tensor, p) -> torch.Tensor:
    """torch's own fake quantization with our params (reference)."""
    if p.scale.dim() == 0:
        return torch.fake_quantize_per_tensor_affine(x, float(p.scale), int(p.zero_point), 0, 255)
    return torch.fake_quantize_per_channel_affine(x, p.scale, p.zero_point, 0, -128, 127)


def test_top_level_names():
    assert netquant.quantize_onnx is quantize_onnx and netquant.quantize_torch is quantize_torch
    assert netquant.QuantizedModel is QuantizedModel


def test_fake_quant_run_equals_torch_reference():
    """ORT scheme on Conv -> Relu -> MaxPool -> Reshape -> Gemm, recomputed with torch's fake-quant ops."""
    qm = quantize_onnx(conv_relu_gemm(), calib_batches((2, 3, 8, 8), 4), quiet=True, activation_observer="minmax")
    qg = qm.qgraph
    init = qg.graph.initializers
    conv, fc, relu = qg.op_configs["conv"], qg.op_configs["fc"], qg.op_configs["relu"]
    x = torch.from_numpy(calib_batches((2, 3, 8, 8), 1, seed=7)[0])

    def bias_fq(b, cfg):  # int32 with scale s_in * s_w, zero point 0
        s = cfg.params.scale
        return torch.round(b / s).clamp(-2**31, 2**31 - 1) * s

    xq = _fq(x, conv.inputs[0].params)
    c = F.conv2d(xq, _fq(init[conv.op.inputs[1]], conv.inputs[1].params),
                 bias_fq(init[conv.op.inputs[2]], conv.inputs[2]), padding=1)
    r = _fq(F.relu(c), relu.outputs[0].params)
    p = F.max_pool2d(r, 2)
    f = p.reshape(2, -1)
    w2 = _fq(init[fc.op.inputs[1]], fc.inputs[1].params)
    y_ref = f @ w2.T + bias_fq(init[fc.op.inputs[2]], fc.inputs[2])
    y = qm.run({"x": x})["y"]
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    y32 = qm.run({"x": x}, fake_quant=False)["y"]
    assert not torch.equal(y, y32) and _cos(y.numpy(), y32.numpy()) > 0.999


def test_export_runs_in_onnxruntime_and_agrees(tmp_path):
    qm = quantize_onnx(residual_concat(), calib_batches((2, 3, 8, 8), 4), quiet=True)
    out = tmp_path / "q.onnx"
    report = qm.export(out)
    assert out.exists() and report.validated
    x = calib_batches((2, 3, 8, 8), 1, seed=3)[0]
    y_ort = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    y_fq = qm.run({"x": x})["y"].numpy()
    assert _cos(y_ort, y_fq) >= 0.999
    qm.export(tmp_path / "q.json", format="json")
    _check_params_json(read_params_json(tmp_path / "q.json"), qm)
    qm.export(tmp_path / "q.cache", format=ExportKind.TENSORRT_CACHE)
    _check_trt_cache(tmp_path / "q.cache", read_params_json(tmp_path / "q.json"))
    with pytest.raises(ConfigError, match="unknown export format 'tfl'; choose one of qdq, json, tensorrt_cache, openvino_ir, tflite, ncnn"):
        qm.export(tmp_path / "q.tflite", format="tfl")


def test_evaluate_and_layer_report():
    batches = calib_batches((2, 3, 8, 8), 3)
    qm = quantize_onnx(conv_relu_gemm(), batches, quiet=True)
    stats = qm.evaluate([{"x": b} for b in batches])
    assert stats["y"]["cosine"] > 0.999 and 20 < stats["y"]["snr_db"] < 80
    labels = [np.argmax(qm.run({"x": b}, fake_quant=False)["y"].numpy(), 1) for b in batches]

    def top1(out, target):
        return float((out["y"].argmax(1).numpy() == target).mean())

    acc = qm.evaluate(list(zip([{"x": b} for b in batches], labels)), metric=top1)
    assert acc["fp32"] == 1.0 and 0.5 <= acc["quantized"] <= 1.0
    errors = qm.layer_report()
    by_op = {e.op: e for e in errors}
    assert by_op["conv"].quantized
    assert by_op["relu"].snr_db > 25 and by_op["relu"].cosine > 0.99
    # SNR of a quantized op output against the definition 10 log10(|x|^2 / |x - xq|^2)
    x = {"x": batches[0]}
    ref = qm.qgraph.executor(fake_quant=False).run(x, outputs=["r"])["r"].double()
    tst = qm.qgraph.executor(fake_quant=True).run(x, outputs=["r"])["r"].double()
    expected = 10 * np.log10(float((ref ** 2).sum()) / float(((ref - tst) ** 2).sum()))
    assert by_op["relu"].snr_db == pytest.approx(expected, rel=1e-9)
    # user data in any form quantize_onnx accepts: a list of arrays, or one dict batch
    from_list = {e.op: e.snr_db for e in qm.layer_report(batches)}
    from_dict = {e.op: e.snr_db for e in qm.layer_report({"x": batches[0]})}
    assert from_list == from_dict and from_list["relu"] == pytest.approx(expected, rel=1e-9)
    with pytest.raises(DataError, match="'x'"):
        qm.layer_report([np.zeros((2, 5, 8, 8), np.float32)])
    s = qm.summary()
    assert s["platform"] == "onnxruntime_int8" and s["quantized_by_type"]["Conv"] == 1


def test_quantize_torch_end_to_end(tmp_path):
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.BatchNorm2d(16), torch.nn.ReLU(),
                                 torch.nn.Flatten(), torch.nn.Linear(16 * 8 * 8, 4))
    module.eval()
    example = torch.randn(1, 3, 8, 8)
    data = [torch.randn(4, 3, 8, 8).numpy() for _ in range(4)]
    qm = quantize_torch(module, example, data, input_names=["x"], dynamic_axes={"x": {0: "N"}}, quiet=True)
    assert {"Conv", "Gemm"} <= {qm.graph.node(n).op_type for n in qm.quantized_ops()}
    assert not any(n.op_type == "BatchNormalization" for n in qm.graph.nodes)  # folded into the Conv
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        ref = module(x).numpy()
    out = next(iter(qm.run({"x": x}).values())).numpy()
    assert _cos(ref, out) > 0.995
    report = qm.export(tmp_path / "torch_q.onnx")
    assert report.validated


def test_missing_model_file():
    with pytest.raises(ModelError, match="does not exist"):
        quantize_onnx("/no/such/model.onnx", calib_batches((1, 3, 8, 8), 1))


def _params(cfg) -> tuple[list[float] | float, list[int] | int]:
    p = cfg.effective_params
    scale, zp = p.scale.reshape(-1).tolist(), p.zero_point.reshape(-1).tolist()
    return (scale[0], zp[0]) if p.scale.dim() == 0 else (scale, zp)


def _check_params_json(data: dict, qm) -> None:
    """residual_concat on onnxruntime_int8: named records hold the configs' state, bits and params."""
    assert data["platform"] == "onnxruntime_int8" and data["model"] == "residual_concat"
    conv1 = qm.qgraph.op_configs["conv1"]
    expected = {  # (node, place): (state, bits, quant_min, quant_max, granularity, config)
        ("conv1", "input:0"): ("ACTIVATED", 8, 0, 255, "per_tensor", conv1.inputs[0]),
        ("conv1", "input:1"): ("ACTIVATED", 8, -128, 127, "per_channel", conv1.inputs[1]),
        ("conv1", "input:2"): ("PASSIVE", 32, -2**31, 2**31 - 1, "per_channel", conv1.inputs[2]),
        ("conv1", "output:0"): ("ACTIVATED", 8, 0, 255, "per_tensor", conv1.outputs[0]),
        ("conv2", "input:0"): ("OVERLAPPED", 8, 0, 255, "per_tensor", qm.qgraph.op_configs["conv2"].inputs[0]),
    }
    for (node, place), (state, bits, qmin, qmax, gran, cfg) in expected.items():
        rec = json_record(data, node, place)
        assert (rec["state"], rec["bits"], rec["quant_min"], rec["quant_max"], rec["granularity"]) == (
            state, bits, qmin, qmax, gran), (node, place)
        assert (rec["scale"], rec["zero_point"]) == _params(cfg), (node, place)
    x, w, b = (json_record(data, "conv1", f"input:{i}") for i in range(3))
    assert (x["tensor"], w["tensor"], b["tensor"]) == ("x", "W1", "B1")
    assert w["zero_point"] == [0] * 16 and w["axis"] == 0 and len(w["scale"]) == 16
    # int32 bias scale = input scale * weight scale, per output channel
    assert b["scale"] == pytest.approx([x["scale"] * sw for sw in w["scale"]], rel=1e-6)
    # an activation range holds 0 and spans 255 steps of the scale
    lo, hi = x["range"]
    assert lo == pytest.approx(-x["zero_point"] * x["scale"]) and hi == pytest.approx((255 - x["zero_point"]) * x["scale"])
    assert json_record(data, "conv2", "input:0")["shares_params_with"] == "a"
    add = json_record(data, "add", "input:0")
    assert add["state"] == "FP32" and "scale" not in add


def _check_trt_cache(path: Path, data: dict) -> None:
    """One entry per quantized activation (Add / Sigmoid / Concat stay float), each amax / 127."""
    header, scales = read_trt_cache(path)
    assert header == "TRT-8601-EntropyCalibration2"
    assert list(scales) == ["x", "a", "b", "cat", "y"]
    emitting = {("x", "conv1", "input:0"), ("a", "conv1", "output:0"), ("b", "conv2", "output:0"),
                ("cat", "conv3", "input:0"), ("y", "conv3", "output:0")}
    for tensor, node, place in emitting:
        rec = json_record(data, node, place)
        assert rec["tensor"] == tensor
        assert scales[tensor] == pytest.approx(symmetric_int8_scale(rec["scale"], rec["zero_point"], 0, 255),
                                              rel=1e-6), tensor


def test_a_dropped_quantized_model_is_freed_without_garbage_collection(tmp_path: Path) -> None:
    """quantize + export, then the caller drops the model: its graph and weights go at once (reference counting), so
    a second quantization in the same process does not run beside the first one's memory until a collection."""
    import gc
    import weakref

    gc.collect()
    gc.disable()
    try:
        qm = quantize_onnx(conv_relu_gemm(), calib_batches((2, 3, 8, 8), 4), quiet=True)
        qm.export(tmp_path / "m.onnx")
        graph, weights = weakref.ref(qm.qgraph), weakref.ref(next(iter(qm.qgraph.graph.initializers.values())))
        del qm
        assert graph() is None and weights() is None
    finally:
        gc.enable()
