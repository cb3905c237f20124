"""Bias that overflows int32 at scale s_in * s_w: the weight scale grows instead of the bias being clipped.

Reference: the FP32 model run in onnxruntime; the exported QDQ model is run in onnxruntime too.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import netquant
from netquant.core.qparams import EPS, QParams
from netquant.export import export_qdq
from netquant.graph import load_onnx
from netquant.passes.base import PassContext
from netquant.passes.bias import BiasOverflowWarning, BiasPass, bias_limit
from netquant.passes.manager import PassManager
from netquant.passes.ptq import default_passes
from netquant.passes.settings import QuantSettings
from tests.helpers.ir import make_model

CIN, COUT, HW = 48, 4, 6  # 48 * 3 * 3 = 432 MACs per output: enough for ORT's QLinearConv rule
FAN_IN = CIN * 9
INT32_MAX = 2**31 - 1


def conv_model(weight: np.ndarray, bias: np.ndarray) -> onnx.ModelProto:
    """x[N, CIN, HW, HW] -> Conv(3x3, pad 1, weight, bias) -> y."""
    node = helper.make_node("Conv", ["x", "w", "b"], ["y"], name="conv", kernel_shape=[3, 3], pads=[1, 1, 1, 1])
    graph = helper.make_graph(
        [node], "bias_overflow",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", CIN, HW, HW])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", weight.shape[0], HW, HW])],
        [numpy_helper.from_array(weight.astype(np.float32), "w"), numpy_helper.from_array(bias.astype(np.float32), "b")])
    model = make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def mixed_model() -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """Channel 0 and 3: ordinary weights and bias. Channel 1: weights ~1e-6, bias 10.
    Channel 2: all-zero weights (a dead channel after BatchNorm folding), bias -15.
    At s_in = 2/255 and s_w = eps, int32 holds |b| up to ~2: channels 1 and 2 overflow."""
    rng = np.random.default_rng(0)
    w = rng.normal(0.0, 0.05, (COUT, CIN, 3, 3))
    w[1] = rng.normal(0.0, 1e-6, (CIN, 3, 3))
    w[2] = 0.0
    b = np.array([0.1, 10.0, -15.0, -0.2])
    return conv_model(w, b), w.astype(np.float32), b.astype(np.float32)


def tiny_weights_model() -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """Every weight ~1e-6 (so even a per-tensor weight scale overflows), biases of order 1."""
    rng = np.random.default_rng(1)
    w = rng.normal(0.0, 1e-6, (COUT, CIN, 3, 3))
    b = np.array([20.0, -30.0, 1.0, 0.5])
    return conv_model(w, b), w.astype(np.float32), b.astype(np.float32)


def inputs(seed: int, n: int = 8) -> np.ndarray:
    x = np.random.default_rng(seed).uniform(-1.0, 1.0, (n, CIN, HW, HW)).astype(np.float32)
    x[0, 0, 0, 0], x[0, 0, 0, 1] = -1.0, 1.0  # calibration range exactly [-1, 1]
    return x


def run_ort(model: onnx.ModelProto | Path, x: np.ndarray, qdq_reference: bool = False) -> np.ndarray:
    """qdq_reference: graph optimizations off, so Q/DQ run as defined (exact int32 products on every CPU,
    as the x86-vnni / ARM target these full-range int8 weights are for computes them)."""
    src = str(model) if isinstance(model, Path) else model.SerializeToString()
    so = ort.SessionOptions()
    if qdq_reference:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def quantize(model: onnx.ModelProto, platform: str,
             **settings: object) -> tuple[netquant.QuantizedModel, list[warnings.WarningMessage]]:
    # full-range int8 weights (min/max scales, the formula these tests check): the x86-vnni / ARM CPU target
    target = {"target": "x86-vnni"} if platform in ("onnxruntime_int8", "openvino_int8") else {}
    target.update(settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qm = netquant.quantize_onnx(model, {"x": inputs(100)}, platform=platform, quiet=True, **target)
    return qm, list(caught)


def conv_configs(qm):
    oc = qm.qgraph.op_configs["conv"]
    roles = {r: oc.inputs[i] for i, r in oc.roles.items()}
    return roles["activation"], roles["weight"], roles["bias"], oc.outputs[0]


def minmax_weight_scale(w: np.ndarray, spec, per_channel: bool) -> np.ndarray:
    """The symmetric scale amax / ((qmax - qmin) / 2) (floored at float32's smallest normal, eps for a zero range),
    computed here from the weights."""
    amax = np.abs(w).reshape(w.shape[0], -1).max(1) if per_channel else np.abs(w).max().reshape(1)
    raw = amax.astype(np.float64) / ((spec.qmax - spec.qmin) / 2)
    return np.where(raw > 0, np.maximum(raw, float(np.finfo(np.float32).tiny)), float(EPS))


# ---- per-channel weights (onnxruntime platform) ----------------------------------------------------

@pytest.fixture(scope="module")
def ort_mixed(tmp_path_factory: pytest.TempPathFactory):
    model, w, b = mixed_model()
    qm, caught = quantize(model, "onnxruntime_int8")
    path = tmp_path_factory.mktemp("bias") / "conv_int8.onnx"
    export_qdq(qm, path)
    return model, w, b, qm, caught, path


def test_overflowing_channels_get_the_formula_weight_scale_and_no_clip(ort_mixed) -> None:
    _, w, b, qm, caught, _ = ort_mixed
    a_cfg, w_cfg, b_cfg, _ = conv_configs(qm)
    messages = [str(c.message) for c in caught if issubclass(c.category, BiasOverflowWarning)]
    assert len(messages) == 1 and "2 of 4 output channel(s)" in messages[0] and "'conv'" in messages[0]
    assert not any("clipped" in str(c.message) for c in caught)
    (adj,) = qm.qgraph.bias_scale_adjustments
    assert (adj.op, adj.channels, adj.total_channels) == ("conv", 2, 4)
    assert any("2 of 4 output channel(s)" in m for m in qm.warnings)

    # limit = int32 max - fan_in * 255 (uint8 span) * 128 (max |int8|), by hand
    w_spec = w_cfg.spec
    limit = INT32_MAX - FAN_IN * 255 * max(-w_spec.qmin, w_spec.qmax)
    assert adj.limit == limit
    s_in = float(a_cfg.effective_params.scale)
    assert 0.99 * 2.0 / 255 < s_in <= 2.0 / 255 * (1 + 1e-6)  # calibrated on [-1, 1]
    got = w_cfg.effective_params.scale.double().numpy()
    before = minmax_weight_scale(w, w_spec, per_channel=True)
    expected = before.copy()
    expected[[1, 2]] = np.abs(b[[1, 2]].astype(np.float64)) / (s_in * limit)
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert (got[[1, 2]] > 3 * before[[1, 2]]).all()  # really enlarged
    # bias config stays PASSIVE with s_b = s_in * s_w' and every |b / s_b| within int32
    b_scale = b_cfg.effective_params.scale.double().numpy()
    np.testing.assert_allclose(b_scale, s_in * got, rtol=1e-6)
    assert b_cfg.state.name == "PASSIVE" and int(b_cfg.effective_params.zero_point.abs().max()) == 0
    assert (np.abs(b / b_scale) <= limit * (1 + 1e-6)).all()


def test_exported_model_matches_fp32_where_clipping_would_not(ort_mixed) -> None:
    model, w, b, qm, _, path = ort_mixed
    a_cfg, w_cfg, b_cfg, out_cfg = conv_configs(qm)
    x = inputs(200)
    ref = run_ort(model, x)
    got = run_ort(path, x, qdq_reference=True)
    out_step = float(out_cfg.effective_params.scale)
    err = np.abs(got - ref).max(axis=(0, 2, 3))
    assert err.max() <= 1.5 * out_step, (err, out_step)

    # the exported int32 bias and int8 weights are the ones the enlarged scales give
    exported = onnx.load(str(path))
    inits = {t.name: numpy_helper.to_array(t) for t in exported.graph.initializer}
    b_q = next(v for k, v in inits.items() if v.dtype == np.int32 and v.shape == (COUT,))
    b_scale = b_cfg.effective_params.scale.double().numpy()
    # (quantization runs in float32: near 2^31 its resolution is 128, a relative 6e-8)
    np.testing.assert_allclose(b_q, np.round(b.astype(np.float64) / b_scale), rtol=2e-7, atol=0.5)
    assert np.abs(b_q).max() < INT32_MAX

    # the old behaviour: bias clipped to +-int32 max at the calibrated (un-enlarged) scale
    s_in = float(a_cfg.effective_params.scale)
    s_w = minmax_weight_scale(w, w_cfg.spec, per_channel=True)
    bound = INT32_MAX * s_in * s_w
    clipped = onnx.load_from_string(model.SerializeToString())
    clipped.graph.initializer[1].CopyFrom(numpy_helper.from_array(np.clip(b, -bound, bound).astype(np.float32), "b"))
    clip_err = np.abs(run_ort(clipped, x) - ref).max(axis=(0, 2, 3))
    assert clip_err[[1, 2]].min() > 20 * out_step  # clipping moves those channels by 8 and 13
    assert err[[1, 2]].max() <= 1.5 * out_step


def test_no_adjustment_when_bias_fits() -> None:
    rng = np.random.default_rng(3)
    w = rng.normal(0.0, 0.05, (COUT, CIN, 3, 3))
    model = conv_model(w, np.array([0.1, -0.5, 1.0, 2.0]))
    qm, caught = quantize(model, "onnxruntime_int8")
    _, w_cfg, _, _ = conv_configs(qm)
    assert qm.qgraph.bias_scale_adjustments == []
    assert not any(issubclass(c.category, BiasOverflowWarning) for c in caught)
    np.testing.assert_allclose(w_cfg.effective_params.scale.double().numpy(),
                               minmax_weight_scale(w, w_cfg.spec, per_channel=True), rtol=1e-6)


# ---- per-tensor weights (PPQ's own academic int8: float outputs) -------------------------------------

def test_per_tensor_weight_scale_enlarged_and_export_matches_fp32(tmp_path: Path) -> None:
    model, w, b = tiny_weights_model()
    qm, caught = quantize(model, "academic_int8", per_channel=False, bias_correction=False)
    assert not any("clipped" in str(c.message) for c in caught)
    a_cfg, w_cfg, b_cfg, _ = conv_configs(qm)
    (adj,) = qm.qgraph.bias_scale_adjustments
    w_spec = w_cfg.spec
    limit = INT32_MAX - FAN_IN * 255 * max(-w_spec.qmin, w_spec.qmax)
    s_in = float(a_cfg.effective_params.scale)
    over = np.abs(b) / (s_in * float(minmax_weight_scale(w, w_spec, per_channel=False)[0])) > limit
    assert over[:2].all() and (adj.channels, adj.per_tensor) == (int(over.sum()), True)  # one scale grows for all
    assert any("per-tensor weight scale of 'w'" in str(c.message) for c in caught)
    got = float(w_cfg.effective_params.scale)
    assert w_cfg.effective_params.scale.numel() == 1
    assert got == pytest.approx(np.abs(b).max() / (s_in * limit), rel=1e-6)
    assert got > 10 * float(minmax_weight_scale(w, w_spec, per_channel=False)[0])
    assert (np.abs(b / (s_in * got)) <= limit * (1 + 1e-6)).all()
    assert b_cfg.effective_params.scale.numel() == 1

    path = tmp_path / "conv_academic.onnx"
    export_qdq(qm, path)
    x = inputs(201)
    ref, out = run_ort(model, x), run_ort(path, x)
    # outputs stay float: the only errors are weight / input rounding (weights ~1e-6) and bias rounding
    np.testing.assert_allclose(out, ref, atol=1e-3)


# ---- power-of-two scales ---------------------------------------------------------------------------

def test_power_of_two_weight_scale_is_rounded_up() -> None:
    model, _, b = mixed_model()
    qm, caught = quantize(model, "pow2_int8")
    assert not any("clipped" in str(c.message) for c in caught)
    a_cfg, w_cfg, b_cfg, _ = conv_configs(qm)
    (adj,) = qm.qgraph.bias_scale_adjustments
    s_in = float(a_cfg.effective_params.scale)
    need = np.abs(b[[1, 2]].astype(np.float64)) / (s_in * adj.limit)
    got = w_cfg.effective_params.scale.double().numpy()[[1, 2]]
    assert np.all(np.log2(got) == np.round(np.log2(got)))  # powers of two
    assert np.all(got >= need) and np.all(got < 2 * need)
    b_scale = b_cfg.effective_params.scale.double().numpy()
    assert (np.abs(b / b_scale) <= b_cfg.spec.qmax).all()


# ---- the limit and the fallback --------------------------------------------------------------------

def test_bias_limit_formula() -> None:
    from netquant.core.spec import QuantSpec
    from netquant.platforms import int32_bias_spec

    b, a, wt = int32_bias_spec(), QuantSpec.uint8_affine(), QuantSpec.int8_per_channel(axis=0)
    assert bias_limit(b, a, wt, 9) == INT32_MAX - 9 * 255 * 128
    narrow = QuantSpec.int8_per_channel(axis=0, narrow_range=True)
    assert bias_limit(b, QuantSpec.int8(), narrow, 100) == INT32_MAX - 100 * 128 * 127
    assert bias_limit(b, a, wt, 10**6) == INT32_MAX // 2  # huge fan-in: at least half of int32 is kept


def test_degenerate_input_scale_falls_back_to_clipping_with_warning() -> None:
    model, _, _ = mixed_model()
    settings = QuantSettings.from_kwargs("onnxruntime_int8", {"quiet": True})
    passes = default_passes(settings, {"x": inputs(100)})
    bias_at = next(i for i, p in enumerate(passes) if isinstance(p, BiasPass))
    ctx = PassContext(settings=settings, graph=load_onnx(model))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        PassManager(passes[:bias_at]).run(ctx)
    oc = ctx.qgraph.op_configs["conv"]
    a_cfg = next(oc.inputs[i] for i, r in oc.roles.items() if r == "activation")
    w_cfg = oc.weight_config()
    a_cfg.params = QParams(scale=torch.tensor(0.0), zero_point=a_cfg.params.zero_point)
    w_before = w_cfg.params.scale.clone()
    with pytest.warns(BiasOverflowWarning, match=r"'conv'.*input scale is 0.*clipped"):
        BiasPass().run(ctx)
    assert ctx.qgraph.bias_scale_adjustments == []
    assert torch.equal(w_cfg.params.scale, w_before)  # nothing enlarged
    assert any("clipped" in m for m in ctx.qgraph.warnings)
