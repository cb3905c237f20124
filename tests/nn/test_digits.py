"""End to end on scikit-learn's digits: train, W8A8 PTQ, QDQ ONNX export, onnxruntime accuracy."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

import netquant.nn as nqnn
from tests.nn.digits import accuracy, trained_digits_cnn


@pytest.fixture(scope="module")
def trained():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, data = trained_digits_cnn(seed=0)
    finally:
        torch.set_num_threads(threads)
    return model, data


@pytest.fixture(scope="module")
def ptq(trained):
    model, (x_tr, _, _, _) = trained
    folded = nqnn.fold_batchnorm(model)
    qmodel = nqnn.quantize_model(folded, nqnn.ModelQuantConfig.int8_tensorrt())
    with nqnn.calibrate(qmodel):
        for i in range(0, 512, 128):
            qmodel(x_tr[i:i + 128])
    return folded, qmodel


def test_fp32_reaches_97_percent(trained):
    model, (_, _, x_te, y_te) = trained
    assert accuracy(model, x_te, y_te) >= 97.0


def test_fold_batchnorm_keeps_outputs(trained, ptq):
    model, (_, _, x_te, _) = trained
    folded, _ = ptq
    assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
    with torch.no_grad():
        torch.testing.assert_close(folded(x_te), model(x_te), rtol=1e-4, atol=1e-4)


def test_w8a8_ptq_within_one_point(trained, ptq):
    model, (_, _, x_te, y_te) = trained
    _, qmodel = ptq
    fp32, int8 = accuracy(model, x_te, y_te), accuracy(qmodel, x_te, y_te)
    assert abs(fp32 - int8) <= 1.0, (fp32, int8)
    # the quantizers really quantize: outputs differ from FP32, but only slightly
    with torch.no_grad():
        diff = (qmodel(x_te) - model(x_te)).abs().max().item()
    assert 0.0 < diff < 1.0


def test_onnx_export_matches_in_onnxruntime(trained, ptq, tmp_path):
    _, (_, _, x_te, y_te) = trained
    _, qmodel = ptq
    path = nqnn.export_onnx(qmodel, x_te[:4], tmp_path / "digits_w8a8.onnx")
    proto = onnx.load(path)
    assert proto.opset_import[0].version >= 13
    ops = [n.op_type for n in proto.graph.node]
    # 3 weighted layers x (input, weight) + pool input; weights stored as int8 initializers (no QuantizeLinear)
    assert ops.count("DequantizeLinear") == 7 and ops.count("QuantizeLinear") == 4
    # per-channel weights carry axis 0 and one scale per output channel
    inits = {i.name: i for i in proto.graph.initializer}
    per_channel = [n for n in proto.graph.node if n.op_type == "DequantizeLinear"
                   and n.input[1] in inits and len(inits[n.input[1]].dims) == 1]
    assert len(per_channel) == 3
    assert all(a.i == 0 for n in per_channel for a in n.attribute if a.name == "axis")

    # default session: onnxruntime fuses the Q/DQ pairs into integer kernels (QLinearConv, ...)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: x_te.numpy()})[0]
    ort_acc = float((logits.argmax(1) == y_te.numpy()).mean()) * 100.0
    torch_acc = accuracy(qmodel, x_te, y_te)
    assert abs(ort_acc - torch_acc) <= 0.3, (ort_acc, torch_acc)
    with torch.no_grad():
        ref = qmodel(x_te).numpy()
    # integer kernels round bias and requantize differently: close, not equal
    assert np.abs(logits - ref).max() < 0.05 * np.abs(ref).max()

    # without graph fusion onnxruntime computes Q/DQ literally: the same numbers as our fake-quant
    # model except where float summation order flips a rounding tie somewhere upstream (< 1%)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    literal = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    logits = literal.run(None, {literal.get_inputs()[0].name: x_te.numpy()})[0]
    close = np.isclose(logits, ref, rtol=1e-4, atol=1e-4)
    assert close.mean() > 0.99, close.mean()
    assert np.abs(logits - ref).max() < 0.02
