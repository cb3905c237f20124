"""TensorQuantizer modes, params and the state_dict round trip."""

from __future__ import annotations

import io

import pytest
import torch
from torch import nn

import netquant.nn as nqnn
from netquant.core.ops import GradMode
from netquant.core.spec import QuantSpec
from netquant.errors import CalibrationError, ConfigError
from netquant.nn.quantizer import QuantizerRole, QuantMode, TensorQuantizer


def test_modes():
    x = torch.linspace(-2, 2, 101)
    q = TensorQuantizer(QuantSpec.int8(), name="q")
    q.start_calibration()
    assert q.mode is QuantMode.CALIBRATE
    assert torch.equal(q(x), x)  # calibration passes data through
    q.finish_calibration()
    assert q.mode is QuantMode.QUANTIZE and q.is_calibrated
    assert q.scale.item() == pytest.approx(2 / 127.5)
    assert torch.equal(q(x), torch.fake_quantize_per_tensor_affine(x, 2 / 127.5, 0, -128, 127))
    q.mode = QuantMode.PASS_THROUGH
    assert torch.equal(q(x), x)
    assert torch.equal(TensorQuantizer(None)(x), x)


def test_per_channel_weight_params_from_weights():
    w = torch.randn(5, 3, 2)
    q = TensorQuantizer(QuantSpec.int8_per_channel(axis=0, narrow_range=True), role=QuantizerRole.WEIGHT)
    params = q.calibrate_from(w)
    torch.testing.assert_close(params.scale, w.abs().amax(dim=(1, 2)) / 127, rtol=1e-6, atol=0)
    assert q.scale.shape == (5,) and q.zero_point.shape == (5,)


def _calibrated_model(config=None) -> tuple[nn.Module, nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))
    q = nqnn.quantize_model(model, config)
    x = torch.randn(6, 3, 6, 6)
    with nqnn.calibrate(q):
        q(x)
    return model, q, x


def test_state_dict_round_trip():
    model, q, x = _calibrated_model()
    state = q.state_dict()
    assert state["0.weight_quantizer.scale"].shape == (8,)
    assert bool(state["0.input_quantizer.calibrated"])
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    fresh = nqnn.quantize_model(model)  # weights calibrated, activations not
    assert not fresh[0].input_quantizer.is_calibrated
    fresh.load_state_dict(torch.load(buffer))
    assert fresh[0].input_quantizer.is_calibrated
    for (name, a), (_, b) in zip(q.state_dict().items(), fresh.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(fresh(x), q(x))


def test_state_dict_round_trip_per_group_and_learnable():
    cfg = nqnn.ModelQuantConfig.w4a16(group_size=16)
    model, q, x = _calibrated_model(cfg)
    assert q[3].weight_quantizer.scale.shape == (4, 8)  # 128 inputs / 16 per group
    nqnn.prepare_qat(q, grad_mode=GradMode.LSQ)
    assert isinstance(q[3].weight_quantizer.scale, nn.Parameter)
    with torch.no_grad():
        q[3].weight_quantizer.scale.mul_(1.1)
    fresh = nqnn.prepare_qat(nqnn.quantize_model(model, cfg), grad_mode=GradMode.LSQ)
    fresh.load_state_dict(q.state_dict())
    assert torch.equal(fresh[3].weight_quantizer.scale, q[3].weight_quantizer.scale)
    assert torch.equal(fresh(x), q(x))


def test_load_into_uncalibrated_pass_through_model_keeps_shapes():
    _, q, x = _calibrated_model()
    blank = TensorQuantizer(QuantSpec.int8_per_channel(axis=0, narrow_range=True), role=QuantizerRole.WEIGHT)
    blank.load_state_dict(q[0].weight_quantizer.state_dict())
    assert blank.scale.shape == (8,) and blank.is_calibrated


def test_uncalibrated_quantize_raises_naming_quantizer():
    q = TensorQuantizer(QuantSpec.int8(), name="features.0.input_quantizer")
    with pytest.raises(CalibrationError, match="features.0.input_quantizer"):
        q(torch.randn(3))


def test_bad_spec_and_observer():
    with pytest.raises(ConfigError, match="QuantSpec"):
        TensorQuantizer("int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        TensorQuantizer(QuantSpec.int8(), observer="no_such_observer", name="q")
    with pytest.raises(ConfigError, match="pass-through"):
        TensorQuantizer(None, name="q").make_learnable()


def test_compute_params_without_data_raises():
    q = TensorQuantizer(QuantSpec.int8(), name="lonely")
    q.start_calibration()
    with pytest.raises(CalibrationError, match="lonely"):
        q.finish_calibration()
