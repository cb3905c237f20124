"""Batched calibration (passes.calib_stack): stacked runs give the scales and zero points of batches run one by one,
for every order-invariant observer, on a small CNN and the built-in encoder with attention masks; where stacking
would change what observers see (batch-dependent observers, an op mixing the batch dim, exact ranges) it is not used."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from netquant.api import quantize_onnx, zoo
from netquant.passes.calib_stack import STACK_MAX_SAMPLES, concat, same_layout, stack_size
from tests.helpers.export_models import conv_net
from tests.helpers.ir import make_model
from tests.helpers.quant_params import tensor_params as _params


def _both(model: Any, batches: list[Any], **settings: Any) -> tuple[Any, Any]:
    """quantize_onnx with batches as given (calib_stack_mb=0) and with stacking (default budget)."""
    kw = {"objective": None, "quiet": True, "threads": 1, **settings}
    return quantize_onnx(model, batches, calib_stack_mb=0, **kw), quantize_onnx(model, batches, **kw)


def _assert_same_params(one: Any, stacked: Any) -> None:
    a, b = _params(one), _params(stacked)
    assert a and a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key][0], b[key][0]) and torch.equal(a[key][1], b[key][1]), key


def _cnn_batches(n: int) -> list[np.ndarray]:
    rng = np.random.default_rng(3)
    return [rng.standard_normal((1, 3, 16, 16)).astype(np.float32) * (1 + i % 3) for i in range(n)]


CASES = [("minmax", {}), ("percentile", {"grid": "pow2"}), ("kl", {"grid": "pow2"}), ("mse", {"grid": "pow2"}),
         ("hist_l2", {"grid": "pow2"})]


@pytest.mark.parametrize(("observer", "options"), CASES)
def test_cnn_stacked_scales_bit_identical(observer: str, options: dict[str, Any]) -> None:
    one, stacked = _both(conv_net(), _cnn_batches(20), activation_observer=observer,
                         observer_options={observer: options} if options else {})
    assert one.qgraph.calibration.executor_runs == 20
    # 3 validation batches one by one, the stacking check, then the other 17 samples in one stack
    assert stacked.qgraph.calibration.stack_blocker == ""
    assert stacked.qgraph.calibration.executor_runs == 5 and stacked.qgraph.calibration.stack_samples > 17
    _assert_same_params(one, stacked)


@pytest.mark.parametrize(("observer", "options"), [("minmax", {})])
def test_encoder_with_masks_stacked_scales_bit_identical(observer: str, options: dict[str, Any]) -> None:
    d = zoo.encoder_inputs(8, seed=5)  # rows of different lengths: masks differ per sample
    batches = [{"x": d["x"][i:i + 1], "mask": d["mask"][i:i + 1]} for i in range(8)]
    one, stacked = _both(str(zoo.encoder_model_path()), batches, activation_observer=observer,
                         observer_options={observer: options} if options else {})
    assert stacked.qgraph.calibration.stack_blocker == "" and stacked.qgraph.calibration.executor_runs == 5
    _assert_same_params(one, stacked)


@pytest.mark.slow
@pytest.mark.parametrize(("observer", "options"), CASES[1:4])
def test_encoder_more_observers_slow(observer: str, options: dict[str, Any]) -> None:
    test_encoder_with_masks_stacked_scales_bit_identical(observer, options)


@pytest.mark.parametrize(("observer", "why"), [("ema", "depends on how samples are batched"),
                                               ("percentile", "depends on how samples are batched"),
                                               ("kl", "depends on how samples are batched")])
def test_batch_dependent_observers_run_batches_as_given(observer: str, why: str) -> None:
    """EMA weights each batch; TensorRT-grid histograms take their bin width from the first batch."""
    one, kept = _both(conv_net(), _cnn_batches(8), activation_observer=observer)
    assert why in kept.qgraph.calibration.stack_blocker and kept.qgraph.calibration.executor_runs == 8
    _assert_same_params(one, kept)


def test_exact_ranges_are_not_stacked() -> None:
    _, kept = _both(conv_net(), _cnn_batches(6), range_bits=None)
    assert "range_bits=None" in kept.qgraph.calibration.stack_blocker and kept.qgraph.calibration.executor_runs == 6


def _batch_mixing_model() -> onnx.ModelProto:
    """y = (x - mean over the batch dim) @ W: each sample's values depend on the others in its batch."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((8, 4)).astype(np.float32), "w")
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], keepdims=1, axes=[0]),
             helper.make_node("Sub", ["x", "m"], ["c"]),
             helper.make_node("MatMul", ["c", "w"], ["y"])]
    graph = helper.make_graph(nodes, "mix", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], [w])
    return make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


def test_op_mixing_the_batch_dim_is_detected() -> None:
    rng = np.random.default_rng(1)
    batches = [rng.standard_normal((2, 8)).astype(np.float32) for _ in range(6)]
    one, kept = _both(_batch_mixing_model(), batches)
    assert "differs from the samples run one by one" in kept.qgraph.calibration.stack_blocker
    assert kept.qgraph.calibration.executor_runs == 6 + 1  # the check's stacked run feeds no observer
    _assert_same_params(one, kept)


def test_batches_of_eight_or_more_run_as_given() -> None:
    rng = np.random.default_rng(2)
    batches = [rng.standard_normal((8, 3, 16, 16)).astype(np.float32) for _ in range(6)]
    one, kept = _both(conv_net(), batches)
    assert kept.qgraph.calibration.stack_blocker == "the batches already hold 8 samples"
    assert kept.qgraph.calibration.executor_runs == 6
    _assert_same_params(one, kept)


def test_static_batch_dim_is_not_stacked() -> None:
    _, kept = _both(conv_net(batch=1), _cnn_batches(5))
    assert "static batch dim 1" in kept.qgraph.calibration.stack_blocker


def test_stack_size_and_layout() -> None:
    assert stack_size(1 << 20, 256) == STACK_MAX_SAMPLES  # 1 MiB per sample: 256 fit, capped at 64
    assert stack_size(10 << 20, 256) == 25  # floor(256 / 10)
    assert stack_size(1 << 30, 256) == 1
    a = {"x": torch.zeros(1, 3), "m": torch.zeros(1, 3, dtype=torch.int64)}
    b = {"x": torch.ones(2, 3), "m": torch.ones(2, 3, dtype=torch.int64)}
    assert same_layout(a, b) and not same_layout(a, {"x": torch.zeros(1, 4), "m": a["m"]})
    assert not same_layout(a, {"x": a["x"], "m": a["m"].float()})
    both = concat([a, b])
    assert both["x"].shape == (3, 3) and torch.equal(both["m"][1:], b["m"])
