"""passes.ptq.run_ptq: calibration data is validated once, in the pass layer, and the API keeps that result."""

from __future__ import annotations

import pytest
import torch

import netquant
from netquant.errors import DataError
from netquant.graph import load_onnx
from netquant.passes.ptq import run_ptq
from netquant.passes.settings import QuantSettings
from tests.helpers.onnx_models import calib_batches, conv_relu_gemm


class CountingList(list):
    """A list that counts how often it is read whole: iterated or sliced (each validation does one of the two)."""

    iterations = 0

    def __iter__(self):
        type(self).iterations += 1
        return super().__iter__()

    def __getitem__(self, key):
        if isinstance(key, slice):
            type(self).iterations += 1
        return super().__getitem__(key)


def test_run_ptq_returns_the_validated_data():
    batches = calib_batches((2, 3, 8, 8), 3)
    run = run_ptq(load_onnx(conv_relu_gemm()), batches, QuantSettings.from_kwargs("onnxruntime_int8", {"quiet": True}))
    assert run.calib_data is not None and run.calib_data.num_batches == 3
    for kept, given in zip(run.calib_data, batches):
        assert torch.equal(kept["x"], torch.from_numpy(given))
    assert set(run.timings) >= {"calibration data", "calibration"}


def test_quantize_onnx_validates_the_calibration_set_once():
    CountingList.iterations = 0
    data = CountingList(calib_batches((2, 3, 8, 8), 3))
    qm = netquant.quantize_onnx(conv_relu_gemm(), data, "onnxruntime_int8", quiet=True)
    assert CountingList.iterations == 1
    assert qm.layer_report()  # the report's default data is the kept, validated set


def test_streamed_data_is_not_kept_and_bad_data_names_the_input():
    qm = netquant.quantize_onnx(conv_relu_gemm(), iter(calib_batches((2, 3, 8, 8), 2)), "onnxruntime_int8",
                                quiet=True)
    with pytest.raises(netquant.errors.ConfigError, match="no calibration data kept"):
        qm.layer_report()
    with pytest.raises(DataError, match="calibration batch 0: input 'x' has shape"):
        netquant.quantize_onnx(conv_relu_gemm(), calib_batches((2, 3, 9, 9), 1), "onnxruntime_int8", quiet=True)
