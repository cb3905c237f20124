"""zoo.encoder_model_path / encoder_inputs: the built-in transformer encoder exports, runs in ORT like torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from netquant.api import zoo


@pytest.fixture(scope="module")
def encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NETQUANT_CACHE", str(tmp_path_factory.mktemp("cache")))
        path = zoo.encoder_model_path()
        assert zoo.encoder_model_path() == path  # second call: the cached file
    return path


def test_encoder_graph_takes_x_and_mask_and_gives_y(encoder: Path) -> None:
    model = onnx.load(str(encoder))
    assert [i.name for i in model.graph.input] == ["x", "mask"]
    assert [o.name for o in model.graph.output] == ["y"]
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Softmax") == zoo.ENCODER_LAYERS and ops.count("LayerNormalization") == 2 * zoo.ENCODER_LAYERS
    # every layer has its own weights (TransformerEncoder deep-copies one layer; the zoo re-initializes each)
    consts = [n.attribute[0].t for n in model.graph.node if n.op_type == "Constant" and n.attribute[0].t.dims]
    weights = sum(int(np.prod(t.dims)) for t in [*model.graph.initializer, *consts])
    per_layer = 4 * zoo.ENCODER_DIM ** 2 + 2 * zoo.ENCODER_DIM * zoo.ENCODER_FF
    assert weights >= zoo.ENCODER_LAYERS * per_layer
    assert not list(encoder.parent.glob(".*.tmp"))  # atomic write left no temp file


def test_encoder_ort_matches_torch_and_mask_matters(encoder: Path) -> None:
    data = zoo.encoder_inputs(6, seed=5)
    session = ort.InferenceSession(str(encoder), providers=["CPUExecutionProvider"])
    y = session.run(None, data)[0]
    with torch.no_grad():  # torch's own (fast-path) kernels as the reference
        ref = zoo._encoder_module()(torch.from_numpy(data["x"]), torch.from_numpy(data["mask"])).numpy()
    assert y.shape == (6, zoo.ENCODER_SEQ, zoo.ENCODER_DIM)
    tokens = data["mask"].astype(bool)  # the fast path leaves padded rows as zeros; compare real tokens
    np.testing.assert_allclose(y[tokens], ref[tokens], atol=1e-4, rtol=1e-4)
    unmasked = session.run(None, {"x": data["x"], "mask": np.ones_like(data["mask"])})[0]
    assert np.abs(unmasked[tokens] - y[tokens]).max() > 0.1  # padding really is excluded from attention


def test_encoder_inputs_are_seeded_padded_token_batches() -> None:
    a, b, c = zoo.encoder_inputs(16, seed=1), zoo.encoder_inputs(16, seed=1), zoo.encoder_inputs(16, seed=2)
    assert a["x"].dtype == np.float32 and a["mask"].dtype == np.int64
    assert a["x"].shape == (16, zoo.ENCODER_SEQ, zoo.ENCODER_DIM) and a["mask"].shape == (16, zoo.ENCODER_SEQ)
    np.testing.assert_array_equal(a["x"], b["x"])
    assert not np.array_equal(a["x"], c["x"])
    lengths = a["mask"].sum(1)
    assert lengths.min() >= 8 and lengths.max() <= zoo.ENCODER_SEQ and len(set(lengths.tolist())) > 4
    for row, n in zip(a["mask"], lengths, strict=True):  # tokens first, then padding
        assert row[:n].all() and not row[n:].any()
    assert not a["x"][~a["mask"].astype(bool)].any()


@pytest.mark.slow
def test_encoder_build_is_byte_identical(encoder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NETQUANT_CACHE", str(tmp_path))
    assert zoo.encoder_model_path().read_bytes() == encoder.read_bytes()
