"""export.onnx_qdq's FP32 base: the large float32 weights are written as headers only until a model holds them (the
QDQ builds quantize from the graph's tensors), with the same headers, model hash and complete FP32 model as ever."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

from netquant.analysis.placement import model_hash
from netquant.api import quantize_onnx
from netquant.export.onnx_qdq import _FP32_BASES, build_qdq_model, fp32_onnx, fp32_onnx_headers
from netquant.graph import to_onnx
from netquant.graph.light import without_initializers
from netquant.graph.save import fill_output_shapes
from tests.helpers.onnx_models import calib_batches, conv_relu_gemm


def test_weights_a_build_quantizes_are_never_written_in_float(tmp_path: Path) -> None:
    qm = quantize_onnx(conv_relu_gemm(), calib_batches((2, 3, 8, 8), 4), quiet=True, objective=None)
    graph = qm.qgraph.graph
    headers = fp32_onnx_headers(qm.qgraph)
    digest = model_hash(qm.qgraph)
    model = build_qdq_model(qm.qgraph)[0]
    base = _FP32_BASES[qm.qgraph]
    assert set(base.pending) == {"W", "W2"}  # 1.7 and 5 KB of float32, both quantized: no float data written
    assert {t.name for t in headers.graph.initializer if not t.raw_data} == {"W", "W2"}
    names = {t.name for t in model.graph.initializer}
    assert "W" not in names and "W2" not in names  # the build holds their int8 codes only
    # the headers and everything but the initializers as the whole model written at once has them: the same hash
    eager = to_onnx(graph, check=False)
    fill_output_shapes(eager, graph)
    assert [(t.name, list(t.dims), t.data_type) for t in headers.graph.initializer] == \
        [(t.name, list(t.dims), t.data_type) for t in eager.graph.initializer]
    assert without_initializers(headers).SerializeToString() == without_initializers(eager).SerializeToString()
    full = fp32_onnx(qm.qgraph)  # complete, in place: the FP32 model the references run
    assert not base.pending and full is headers
    assert full.SerializeToString() == eager.SerializeToString()
    assert model_hash(qm.qgraph) == digest
    x = calib_batches((2, 3, 8, 8), 1, seed=5)[0]
    got = ort.InferenceSession(full.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = ort.InferenceSession(conv_relu_gemm().SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    for t in full.graph.initializer:
        np.testing.assert_array_equal(numpy_helper.to_array(t), graph.initializers[t.name].numpy())


def test_a_large_weight_kept_float_is_written_into_the_file(tmp_path: Path) -> None:
    """A weight the file keeps in float (here: the Gemm, force_fp32) carries its
    data: the build fills it from the graph's tensor."""
    qm = quantize_onnx(conv_relu_gemm(), calib_batches((2, 3, 8, 8), 4), quiet=True, objective=None,
                       force_fp32=["fc"])
    path = tmp_path / "m.onnx"
    qm.export(path)
    saved = {t.name: t for t in onnx.load(str(path)).graph.initializer}
    np.testing.assert_array_equal(numpy_helper.to_array(saved["W2"]), qm.qgraph.graph.initializers["W2"].numpy())
    assert "W" not in saved and set(_FP32_BASES[qm.qgraph].pending) <= {"W"}
