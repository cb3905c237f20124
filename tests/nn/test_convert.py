"""quantize_model: ordered wildcard rules, presets, copies vs in place, bad input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import netquant.nn as nqnn
from netquant.core.spec import Granularity, QuantFormat
from netquant.errors import CalibrationError, ConfigError, DataError
from netquant.nn.rules import LayerQuantConfig, QuantizerConfig, QuantRule


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.ConvTranspose2d(8, 4, 2, stride=2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))
        self.gate = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.pool(self.backbone(x))
        return self.head(z) + self.gate(torch.flatten(z, 1))


def test_presets_and_first_match_wins():
    torch.manual_seed(0)
    model = Net()
    cfg = nqnn.ModelQuantConfig.int8_tensorrt().keep_float("head.*")
    q = nqnn.quantize_model(model, cfg)
    assert q is not model and type(model.backbone[0]) is nn.Conv2d  # the original is untouched
    assert isinstance(q.backbone[0], nqnn.QuantConv2d) and isinstance(q.gate, nqnn.QuantLinear)
    assert type(q.head[1]) is nn.Linear and type(q.head[3]) is nn.Linear  # head.* stays FP32
    w = q.backbone[0].weight_quantizer.spec
    assert (w.bits, w.granularity, w.axis, w.narrow_range) == (8, Granularity.PER_CHANNEL, 0, True)
    assert q.backbone[2].weight_quantizer.spec.axis == 1  # ConvTranspose output channels
    assert q.backbone[2].weight_quantizer.scale.shape == (4,)
    assert q.gate.input_quantizer.spec.granularity is Granularity.PER_TENSOR


def test_rules_by_type_and_name_in_place():
    model = Net()
    int4 = QuantizerConfig(nqnn.ModelQuantConfig.w4a4().rules[0].layer.weight.spec)
    cfg = nqnn.ModelQuantConfig((
        QuantRule(pattern="gate", layer=None),
        QuantRule(types=(nn.Linear,), layer=LayerQuantConfig(weight=int4)),
        QuantRule(pattern="backbone.*", types=(nn.Conv2d,), layer=LayerQuantConfig(weight=int4)),
    ))
    q = nqnn.quantize_model(model, cfg, inplace=True)
    assert q is model
    assert type(model.gate) is nn.Linear
    assert isinstance(model.head[1], nqnn.QuantLinear) and model.head[1].weight_quantizer.spec.bits == 4
    assert not model.head[1].input_quantizer.enabled  # weight-only
    assert isinstance(model.backbone[0], nqnn.QuantConv2d)
    assert type(model.backbone[2]) is nn.ConvTranspose2d and type(model.pool) is nn.AdaptiveAvgPool2d
    model(torch.randn(1, 3, 6, 6))  # weight-only quantization runs without calibration


def test_all_presets_run():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6, 6)
    model = Net()
    for cfg in (nqnn.ModelQuantConfig.int8_tensorrt(), nqnn.ModelQuantConfig.w4a16(group_size=8),
                nqnn.ModelQuantConfig.w4a4(), nqnn.ModelQuantConfig.fp8()):
        q = nqnn.quantize_model(model, cfg)
        with nqnn.calibrate(q):
            q(x)
        y = q(x)
        assert torch.isfinite(y).all() and y.shape == (4, 3)
        assert (y - model(x)).abs().max() < 1.0, cfg.name
    fp8 = nqnn.quantize_model(model, nqnn.ModelQuantConfig.fp8())
    assert fp8.gate.weight_quantizer.spec.fmt is QuantFormat.FP8_E4M3
    w4 = nqnn.quantize_model(model, nqnn.ModelQuantConfig.w4a16(group_size=8))
    assert w4.head[3].weight_quantizer.spec.granularity is Granularity.PER_GROUP
    assert w4.head[3].weight_quantizer.scale.shape == (3, 2)  # 16 inputs / 8 per group
    # 4 inputs are not a multiple of 8: that layer falls back to per-channel
    assert w4.head[1].weight_quantizer.spec.granularity is Granularity.PER_CHANNEL


def test_no_supported_module():
    with pytest.raises(ConfigError, match="no supported module"):
        nqnn.quantize_model(nn.Sequential(nn.ReLU(), nn.Softmax(dim=1)))


def test_rules_that_keep_everything_float():
    with pytest.raises(ConfigError, match="nothing was quantized"):
        nqnn.quantize_model(Net(), nqnn.ModelQuantConfig.int8_tensorrt().keep_float("*"))


def test_bad_arguments():
    with pytest.raises(ConfigError, match="torch.nn.Module"):
        nqnn.quantize_model("model")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="ModelQuantConfig"):
        nqnn.quantize_model(Net(), {"weights": "int8"})  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="QuantRule"):
        nqnn.ModelQuantConfig(("head.*",))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="QuantSpec"):
        QuantizerConfig("int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mode"):
        nqnn.set_quant_mode(Net(), "fast")


def test_calibrate_without_batches_names_quantizers():
    q = nqnn.quantize_model(Net())
    with pytest.raises(CalibrationError, match=r"backbone\.0\.input_quantizer.*gate\.input_quantizer"), \
            nqnn.calibrate(q):
        pass


def test_calibrate_names_unreached_modules():
    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.used, self.unused = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            return self.used(x)

    q = nqnn.quantize_model(Branchy())
    with pytest.raises(CalibrationError, match="saw no data for 1 quantizer") as err, nqnn.calibrate(q):
        q(torch.randn(2, 4))
    assert "unused.input_quantizer" in str(err.value) and "used.input_quantizer," not in str(err.value)


def test_calibrate_on_unquantized_model():
    with pytest.raises(ConfigError, match="quantize_model"), nqnn.calibrate(nn.Linear(2, 2)):
        pass


def test_calibrate_nan_data_raises_data_error():
    q = nqnn.quantize_model(nn.Linear(3, 2))
    x = torch.tensor([[1.0, float("nan"), 2.0]])
    with pytest.raises(DataError, match="input_quantizer.*NaN"), nqnn.calibrate(q):
        q(x)


def test_exception_inside_calibrate_restores_modes():
    q = nqnn.quantize_model(nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match="boom"), nqnn.calibrate(q):
        q(torch.randn(2, 3))
        raise RuntimeError("boom")
    assert q.input_quantizer.mode is nqnn.QuantMode.QUANTIZE and not q.input_quantizer.is_calibrated


def test_calibrate_with_named_observer():
    torch.manual_seed(0)
    q = nqnn.quantize_model(nn.Linear(8, 2))
    x = torch.randn(512, 8)
    x[0, 0] = 100.0  # one outlier
    with nqnn.calibrate(q, observer="percentile", percentile=99.9):
        q(x)
    assert q.input_quantizer.observer_name == "percentile"
    assert q.input_quantizer.scale.item() < 100.0 / 127 / 4  # clipped the outlier
    q2 = nqnn.quantize_model(nn.Linear(8, 2))
    with nqnn.calibrate(q2):
        q2(x)
    # the default preset is TensorRT int8: symmetric narrow [-127, 127], s = amax / 127
    assert q2.input_quantizer.scale.item() == pytest.approx(100.0 / 127)


def test_calibrate_runs_in_eval_mode_and_restores_training_flag():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    q = nqnn.quantize_model(model)
    q.train()
    mean_before = q[1].running_mean.clone()
    with nqnn.calibrate(q):
        assert not q.training
        q(torch.randn(8, 4) + 3)
    assert q.training
    assert torch.equal(q[1].running_mean, mean_before)  # BN statistics untouched by calibration


def test_quantizing_twice_says_so():
    q = nqnn.quantize_model(nn.Sequential(nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match="already quantized"):
        nqnn.quantize_model(q)
