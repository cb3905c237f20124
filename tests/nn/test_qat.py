"""QAT: LSQ gradients (vs torch's learnable fake-quant kernel), STE tracking and freezing, BN folding."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import netquant.nn as nqnn
from netquant.core.ops import GradMode
from netquant.core.spec import QuantSpec
from netquant.errors import CalibrationError, ConfigError
from netquant.nn.quantizer import TensorQuantizer
from tests.helpers.ranges import amax_out


def test_lsq_gradients_match_torch_learnable_fake_quant():
    torch.manual_seed(0)
    x = torch.randn(64) * 2
    q = TensorQuantizer(QuantSpec(bits=4, signed=False, symmetric=False), name="act")
    q.calibrate_from(x)
    q.make_learnable(learn_zero_point=True)
    x1 = x.clone().requires_grad_(True)
    y = q(x1)
    (y * torch.linspace(-1, 1, 64)).sum().backward()

    scale = q.scale.detach().clone().reshape(1).requires_grad_(True)
    zp = q.zero_point.detach().clone().reshape(1).requires_grad_(True)
    x2 = x.clone().requires_grad_(True)
    grad_factor = 1.0 / (64 * 15) ** 0.5
    ref = torch._fake_quantize_learnable_per_tensor_affine(x2, scale, zp, 0, 15, grad_factor)
    (ref * torch.linspace(-1, 1, 64)).sum().backward()
    torch.testing.assert_close(y, ref)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(q.scale.grad.reshape(1), scale.grad, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(q.zero_point.grad.reshape(1), zp.grad, rtol=1e-4, atol=1e-6)


def _toy_problem():
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).long()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(100):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, x, y


def test_lsq_qat_with_plain_optimizer_lowers_loss():
    model, x, y = _toy_problem()
    q = nqnn.quantize_model(model, nqnn.ModelQuantConfig.w4a4(activation_observer="minmax"))
    with nqnn.calibrate(q):
        q(x)
    nqnn.prepare_qat(q, grad_mode=GradMode.LSQ)
    scales_before = q[0].weight_quantizer.scale.detach().clone()
    opt = torch.optim.Adam(q.parameters(), lr=1e-3)
    q.train()
    losses = []
    for _ in range(30):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(q(x), y)
        loss.backward()
        assert q[0].weight_quantizer.scale.grad is not None
        assert q[2].input_quantizer.scale.grad.abs().item() > 0
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    assert not torch.equal(q[0].weight_quantizer.scale.detach(), scales_before)
    nqnn.freeze_observers(q)
    assert not q[0].weight_quantizer.scale.requires_grad


def test_lsq_needs_calibration():
    q = nqnn.quantize_model(nn.Linear(4, 2))
    with pytest.raises(CalibrationError, match="input_quantizer"):
        nqnn.prepare_qat(q)
    with pytest.raises(ConfigError, match="quantize_model"):
        nqnn.prepare_qat(nn.Linear(4, 2))


def test_ste_tracks_then_freezes_after_n_steps():
    model, x, y = _toy_problem()
    q = nqnn.quantize_model(model)
    with nqnn.calibrate(q):
        q(x)
    nqnn.prepare_qat(q, grad_mode=GradMode.STE_CLIP, freeze_after=3)
    opt = torch.optim.SGD(q.parameters(), lr=0.5)
    q.train()
    seen = []
    for _ in range(6):
        opt.zero_grad()
        nn.functional.cross_entropy(q(x), y).backward()
        seen.append(q[0].weight.detach().clone())  # the weights the forward just used
        opt.step()
    wq = q[0].weight_quantizer
    assert wq.frozen and int(wq.tracked_steps) == 3
    expected = seen[2].abs().amax(dim=1) / 127  # params of the 3rd (last tracked) step
    torch.testing.assert_close(wq.scale, expected, rtol=1e-6, atol=0)
    assert not torch.allclose(wq.scale, q[0].weight.detach().abs().amax(dim=1) / 127)
    assert q[0].weight.grad is not None


def test_fold_batchnorm_fx_and_linear():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)
            self.bn = nn.BatchNorm2d(4)
            self.fc = nn.Linear(4 * 4 * 4, 5, bias=False)
            self.bn1 = nn.BatchNorm1d(5)

        def forward(self, x):
            return self.bn1(self.fc(torch.relu(self.bn(self.conv(x))).flatten(1)))

    torch.manual_seed(0)
    net = Net()
    net.train()
    for _ in range(3):
        net(torch.randn(8, 3, 6, 6))  # non-trivial running statistics
    net.eval()
    with torch.no_grad():
        net.bn.weight.uniform_(0.5, 1.5)
        net.bn.bias.uniform_(-0.5, 0.5)
    folded = nqnn.fold_batchnorm(net)
    assert isinstance(folded.bn, nn.Identity) and isinstance(folded.bn1, nn.Identity)
    assert isinstance(net.bn, nn.BatchNorm2d)  # original untouched
    x = torch.randn(4, 3, 6, 6)
    torch.testing.assert_close(folded(x), net(x), rtol=1e-5, atol=1e-5)


def test_fold_batchnorm_untraceable_falls_back_to_sequential():
    class Dynamic(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv1d(2, 3, 3), nn.BatchNorm1d(3))

        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: fx cannot trace it
                return self.body(x)
            return -self.body(x)

    torch.manual_seed(0)
    net = Dynamic().eval()
    with torch.no_grad():
        net.body[1].running_mean.uniform_(-1, 1)
        net.body[1].running_var.uniform_(0.5, 2)
    folded = nqnn.fold_batchnorm(copy.deepcopy(net), inplace=True)
    assert isinstance(folded.body[1], nn.Identity)
    x = torch.randn(2, 2, 8).abs()
    torch.testing.assert_close(folded(x), net(x), rtol=1e-5, atol=1e-5)


def test_learnable_from_config():
    from netquant.nn.rules import LayerQuantConfig, QuantizerConfig, QuantRule

    spec = QuantSpec.int8()
    layer = LayerQuantConfig(input=QuantizerConfig(spec, learnable=True))
    q = nqnn.quantize_model(nn.Linear(4, 2), nqnn.ModelQuantConfig((QuantRule(layer=layer),)))
    assert q.input_quantizer.is_learnable and q.input_quantizer.grad_mode is GradMode.LSQ
    x = torch.randn(16, 4)
    with nqnn.calibrate(q):
        q(x)
    assert q.input_quantizer.scale.item() == pytest.approx(amax_out(x.abs().max()) / 127.5)
    q.train()
    q(x).sum().backward()
    assert q.input_quantizer.scale.grad is not None


def _conv_bn_net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6), nn.ReLU(), nn.Flatten(),
                        nn.Linear(6 * 5 * 5, 3))
    net.train()
    for _ in range(3):
        net(torch.randn(8, 3, 5, 5) * 2 + 1)  # non-trivial running statistics
    with torch.no_grad():
        net[1].weight.uniform_(0.5, 1.5)
        net[1].bias.uniform_(-0.5, 0.5)
    return net.eval()


def test_fuse_conv_bn_float_pair_is_exact():
    net = _conv_bn_net()
    fused = nqnn.fuse_conv_bn(net)
    assert isinstance(fused[0], nqnn.ConvBn2d) and isinstance(fused[1], nn.Identity)
    x = torch.randn(4, 3, 5, 5)
    assert torch.equal(fused(x), net(x))


def test_quant_conv_bn_eval_is_the_folded_conv():
    net = _conv_bn_net()
    q = nqnn.quantize_model(nqnn.fuse_conv_bn(net))
    assert isinstance(q[0], nqnn.QuantConvBn2d)
    assert isinstance(q[0].conv, nn.Conv2d) and type(q[0].conv) is nn.Conv2d  # inner conv not re-quantized
    x = torch.randn(4, 3, 5, 5)
    with nqnn.calibrate(q):
        q(x)
    folded = nqnn.fold_batchnorm(net)
    nqnn.set_quant_mode(q, "pass_through")
    torch.testing.assert_close(q(x), folded(x), rtol=1e-5, atol=1e-5)
    nqnn.set_quant_mode(q, "quantize")
    # hand reference: int8 narrow per-channel weights of the folded conv, int8 narrow per-tensor input
    # (the TensorRT preset: s = amax / 127, codes in [-127, 127]; the input's amax rounded outward to 8 bits)
    w = folded[0].weight.detach()
    s_w = w.abs().amax(dim=(1, 2, 3)) / 127
    w_fq = torch.fake_quantize_per_channel_affine(w, s_w, torch.zeros(6, dtype=torch.int32), 0, -127, 127)
    x_fq = torch.fake_quantize_per_tensor_affine(x, amax_out(x.abs().max()) / 127, 0, -127, 127)
    expected = nn.functional.conv2d(x_fq, w_fq, folded[0].bias, padding=1)
    torch.testing.assert_close(q[0](x), expected, rtol=1e-5, atol=1e-5)


def test_quant_conv_bn_qat_updates_bn_statistics_and_exports(tmp_path):
    import numpy as np
    import onnxruntime as ort

    net = _conv_bn_net()
    x = torch.randn(32, 3, 5, 5)
    y = torch.randint(0, 3, (32,))
    q = nqnn.quantize_model(nqnn.fuse_conv_bn(net))
    with nqnn.calibrate(q):
        q(x)
    nqnn.prepare_qat(q, grad_mode=GradMode.LSQ)
    mean_before = q[0].bn.running_mean.clone()
    opt = torch.optim.Adam(q.parameters(), lr=1e-2)
    q.train()
    first = last = None
    for _ in range(15):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(q(x), y)
        loss.backward()
        opt.step()
        first = loss.item() if first is None else first
        last = loss.item()
    assert last < first
    assert not torch.equal(q[0].bn.running_mean, mean_before)
    assert q[0].conv.weight.grad is not None and q[0].bn.weight.grad is not None
    q.eval()
    path = nqnn.export_onnx(q, x[:2], tmp_path / "convbn.onnx")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        np.testing.assert_allclose(got, q(x).numpy(), rtol=1e-4, atol=1e-4)
