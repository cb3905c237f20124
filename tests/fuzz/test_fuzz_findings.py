"""What the fuzz tier found, pinned as plain regression tests."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import netquant
from netquant.data.calib import ModelInput, load_arrays, random_data
from netquant.errors import DataError
from tests.fuzz.fuzzgen import conv_model


def test_quantize_onnx_takes_serialized_bytes_and_refuses_string_arrays() -> None:
    raw = conv_model(np.random.default_rng(0)).SerializeToString()
    x = np.random.default_rng(1).standard_normal((1, 3, 6, 6)).astype(np.float32)
    qm = netquant.quantize_onnx(raw, [x], quiet=True)
    (ref,) = ort.InferenceSession(raw, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(qm.run({"x": x}, fake_quant=False)["y"].numpy(), ref, rtol=1e-4, atol=1e-5)
    with pytest.raises(DataError, match="dtype <U"):
        netquant.quantize_onnx(raw, [{"x": x.astype(str)}], quiet=True)


def test_random_data_refuses_a_huge_declared_dim() -> None:
    with pytest.raises(DataError, match="random data for input 'x'.*limit"):
        random_data([ModelInput("x", (1, 3, 2**31 + 4))])


def test_object_arrays_in_npz_are_a_data_error(tmp_path: Path) -> None:
    np.savez(tmp_path / "c.npz", x=np.array([{"a": 1}] * 2, dtype=object))
    with pytest.raises(DataError, match="cannot read array 'x'"):
        load_arrays(tmp_path / "c.npz", [ModelInput("x", ("N", 3))])


def test_a_node_name_that_is_not_utf8_is_a_model_error() -> None:
    """Seed 1534: a bit flip in an If branch's node name; protobuf hands invalid UTF-8 over as bytes."""
    from netquant.errors import ModelError
    from netquant.graph import load_onnx
    from tests.fuzz.fuzzgen import if_model

    raw = if_model(np.random.default_rng(0)).SerializeToString()
    flipped = raw.replace(b"else_neg", b"els\xe5_neg")
    with pytest.raises(ModelError, match=r"subgraph of 'branch'.*not valid UTF-8 \(b'els\\xe5_neg'\)"):
        load_onnx(flipped)
