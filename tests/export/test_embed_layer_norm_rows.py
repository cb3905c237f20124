"""com.microsoft EmbedLayerNormalization (onnxruntime.transformers.optimizer's embedding node) with int8-row tables:
netquant quantizes its word / position tables per row and the export writes Gathers of int8 rows + LayerNormalization
(export.ort_patterns.embed_layer_norm_rows); checked in onnxruntime against the float EmbedLayerNormalization."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

import netquant
from tests.helpers.ir import make_model

VOCAB, DIM, MAXPOS = 600, 64, 128


def _model(segment: bool) -> onnx.ModelProto:
    """EmbedLayerNormalization -> MatMul (so the mask count and embedding are both read), outputs y and mask_index."""
    rng = np.random.default_rng(0)
    inits = {
        "word": rng.normal(0, 0.5, (VOCAB, DIM)).astype(np.float32),
        "pos": rng.normal(0, 0.2, (MAXPOS, DIM)).astype(np.float32),
        "seg": rng.normal(0, 0.2, (2, DIM)).astype(np.float32),
        "gamma": rng.normal(1, 0.1, DIM).astype(np.float32),
        "beta": rng.normal(0, 0.1, DIM).astype(np.float32),
        "w": rng.normal(0, 0.1, (DIM, DIM)).astype(np.float32),
    }
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT32, ["b", "s"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT32, ["b", "s"])]
    if segment:
        inputs.append(helper.make_tensor_value_info("token_type_ids", TensorProto.INT32, ["b", "s"]))
    eln = helper.make_node("EmbedLayerNormalization",
                           ["input_ids", "token_type_ids" if segment else "", "word", "pos", "seg" if segment else "",
                            "gamma", "beta", "attention_mask"], ["emb", "mask_index"], name="embed",
                           domain="com.microsoft", epsilon=1e-12)
    mm = helper.make_node("MatMul", ["emb", "w"], ["y"], name="proj")
    graph = helper.make_graph([eln, mm], "eln", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", DIM]),
                               helper.make_tensor_value_info("mask_index", TensorProto.INT32, ["b"])],
                              [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def _feeds(batch: int, seq: int, seed: int, segment: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.ones((batch, seq), np.int32)
    mask[0, seq // 2:] = 0
    feeds = {"input_ids": rng.integers(0, VOCAB, (batch, seq)).astype(np.int32), "attention_mask": mask}
    if segment:
        feeds["token_type_ids"] = (np.arange(seq)[None, :] >= seq // 3).astype(np.int32).repeat(batch, 0)
    return feeds


def _run(model: onnx.ModelProto | str, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)


def test_int8_row_tables_replace_embed_layer_norm(tmp_path: Path) -> None:
    for segment in (True, False):
        model = _model(segment)
        calib = [_feeds(2, 16, i, segment) for i in range(4)]
        qm = netquant.quantize_onnx(model, calib, quiet=True, objective=None)
        out = qm.export(tmp_path / f"eln_{segment}.onnx").path
        q = onnx.load(str(out))
        ops = Counter(n.op_type for n in q.graph.node)
        assert ops["EmbedLayerNormalization"] == 0 and ops["LayerNormalization"] == 1
        word = next(t for t in q.graph.initializer if list(t.dims) == [VOCAB, DIM])
        assert word.data_type == TensorProto.INT8  # the table is stored in int8
        for batch, seq in ((1, 7), (3, 40)):
            feeds = _feeds(batch, seq, 100 + seq, segment)
            ref_y, ref_count = _run(model, feeds)
            y, count = _run(str(out), feeds)
            np.testing.assert_array_equal(count, ref_count)  # mask_index: tokens per row
            a, b = ref_y.ravel().astype(np.float64), y.ravel().astype(np.float64)
            assert a @ b / (np.linalg.norm(a) * np.linalg.norm(b)) > 0.999
