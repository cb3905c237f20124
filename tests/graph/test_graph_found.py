"""Graph loading and folding errors that gave tracebacks or misleading hints (issue 19)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

from netquant.api import quantize_onnx
from netquant.errors import ModelError
from netquant.graph import load_onnx
from netquant.graph.edit import fold_constants
from tests.helpers.found_models import bad_constant_reshape

MESSAGE = (r"node 'bad_reshape' \(Reshape\) fails on its constant inputs \(c, shp\): shape '\[4, 2\]' is invalid for "
           r"input of size 6; the model is invalid")


def test_an_invalid_constant_reshape_is_a_model_error_naming_the_node() -> None:
    model = bad_constant_reshape()
    with pytest.raises(Exception, match="cannot be reshaped"):  # the reference: onnxruntime fails on it as well
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
            None, {"x": np.ones((4, 2), np.float32)})
    with pytest.raises(ModelError, match=MESSAGE):
        fold_constants(load_onnx(model))
    with pytest.raises(ModelError, match=MESSAGE):
        quantize_onnx(model, [np.ones((4, 2), np.float32)], quiet=True)


def _external(tmp_path, keep_bytes: int | None) -> tuple:
    import onnx

    from tests.helpers.found_models import wide_conv

    path = tmp_path / "m.onnx"
    onnx.save(wide_conv(), path, save_as_external_data=True, location="m.onnx.data", size_threshold=0)
    data = tmp_path / "m.onnx.data"
    full = data.stat().st_size
    if keep_bytes is None:
        data.unlink()
    else:
        with open(data, "r+b") as f:
            f.truncate(keep_bytes)
    return path, data, full


def test_a_truncated_external_data_file_is_named_as_truncated(tmp_path) -> None:
    path, data, full = _external(tmp_path, keep_bytes=1000)
    with pytest.raises(ModelError, match=f"data file '{data}' holds 1000 bytes but tensor 'w' needs bytes 0..{full}: "
                                         "the file is truncated"):
        load_onnx(path)


def test_a_missing_external_data_file_is_named(tmp_path) -> None:
    path, data, _ = _external(tmp_path, keep_bytes=None)
    with pytest.raises(ModelError, match=f"tensor 'w' is stored in '{data}', which does not exist"):
        load_onnx(path)
