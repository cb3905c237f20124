"""graph.weights.ExternalDataReader: initializers read from external data (one shared map for small files, a map per
tensor for large ones) equal what onnx loads; a truncated file is a ModelError naming it."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from netquant.errors import ModelError
from netquant.graph import weights
from netquant.graph.weights import ExternalDataReader
from tests.helpers.ir import make_model


def _model(tmp_path):
    rng = np.random.default_rng(0)
    arrays = {"a": rng.standard_normal((64, 48)).astype(np.float32), "b": rng.standard_normal((300,)).astype(np.float32),
              "c": rng.integers(-5, 5, size=(40, 7)).astype(np.int64)}
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])],
                              [numpy_helper.from_array(v, k) for k, v in arrays.items()])
    path = tmp_path / "m.onnx"
    onnx.save_model(make_model(graph), str(path), save_as_external_data=True, location="m.onnx.data",
                    size_threshold=0)
    return path, arrays


@pytest.mark.parametrize("shared_limit", [1 << 30, 0])
def test_reader_returns_the_saved_arrays(tmp_path, monkeypatch, shared_limit) -> None:
    monkeypatch.setattr(weights, "_SHARED_MAP_BYTES", shared_limit)
    path, arrays = _model(tmp_path)
    model = onnx.load_model(str(path), load_external_data=False)
    reader = ExternalDataReader(path.parent)
    for t in model.graph.initializer:
        assert t.data_location == TensorProto.EXTERNAL
        got = reader.array(t)
        assert got.dtype == arrays[t.name].dtype and np.array_equal(got, arrays[t.name])


def test_reader_names_a_truncated_data_file(tmp_path) -> None:
    path, _ = _model(tmp_path)
    model = onnx.load_model(str(path), load_external_data=False)
    data = path.with_name("m.onnx.data")
    with open(data, "r+b") as f:
        f.truncate(100)
    last = max(model.graph.initializer, key=lambda t: int({e.key: e.value for e in t.external_data}["offset"]))
    for e in last.external_data:  # without a length entry only the file size can tell
        if e.key == "length":
            last.external_data.remove(e)
            break
    with pytest.raises(ModelError, match="m.onnx.data.*truncated"):
        ExternalDataReader(path.parent).array(last)
