"""fold_constants on an op that cannot run on its constant inputs (issue 19: a torch RuntimeError traceback)."""

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
