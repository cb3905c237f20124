"""NVIDIA-style tensor_quant / fake_tensor_quant: the issue's vectors, per-channel amax, edge cases."""

from __future__ import annotations

import pytest
import torch

import netquant
from netquant.core.amax_quant import fake_tensor_quant, tensor_quant
from netquant.errors import ConfigError, DataError


def test_issue_vectors() -> None:
    torch.manual_seed(12345)
    x = torch.rand(10)
    fq = netquant.fake_tensor_quant(x, x.abs().max())
    want = torch.tensor([0.9843, 0.8828, 0.9921, 0.4609, 0.0859, 0.1797, 0.3672, 0.5703, 0.3359, 0.2109])
    assert torch.allclose(fq, want, atol=5e-5, rtol=0)
    q, scale = netquant.tensor_quant(x, x.abs().max())
    assert q.tolist() == [126.0, 113.0, 127.0, 59.0, 11.0, 23.0, 47.0, 73.0, 43.0, 27.0]
    assert scale.item() == pytest.approx(128.0057, abs=5e-5)
    assert scale.item() == (torch.tensor(127.0) / x.abs().max()).item()
    assert torch.equal(fq, q / scale)


def test_formula_bounds_and_narrow_range() -> None:
    x = torch.tensor([-1.0, -0.5, 0.0, 0.5, 1.0])
    q, s = tensor_quant(x, 1.0)  # narrow range by default: [-127, 127]
    assert q.tolist() == [-127.0, -64.0, 0.0, 64.0, 127.0] and s.item() == 127.0  # 63.5 -> 64 (half-even)
    q, _ = tensor_quant(x * 2, 1.0, narrow_range=False)
    assert q.tolist() == [-128.0, -127.0, 0.0, 127.0, 127.0]
    q, s = tensor_quant(x.abs(), 1.0, unsigned=True)
    assert s.item() == 255.0 and q.tolist() == [255.0, 128.0, 0.0, 128.0, 255.0]  # 127.5 -> 128
    q, s = tensor_quant(x, 1.0, num_bits=4)
    assert s.item() == 7.0 and q.tolist() == [-7.0, -4.0, 0.0, 4.0, 7.0]  # 3.5 -> 4


def test_per_channel_amax_broadcasts() -> None:
    w = torch.tensor([[1.0, -2.0], [0.1, 0.05]])
    amax = w.abs().amax(dim=1, keepdim=True)
    q, s = tensor_quant(w, amax)
    assert s.shape == (2, 1)
    assert q.tolist() == [[64.0, -127.0], [127.0, 64.0]]  # 63.5 -> 64, 63.5 -> 64
    assert torch.equal(fake_tensor_quant(w, amax), q / s)


def test_zero_amax_quantizes_to_zero_with_unit_scale() -> None:
    x = torch.tensor([[0.0, 0.0], [0.3, -0.2]])
    amax = torch.tensor([[0.0], [0.3]])
    q, s = tensor_quant(x, amax)
    assert s[0].item() == 1.0 and q[0].tolist() == [0.0, 0.0]
    assert torch.isfinite(fake_tensor_quant(x, amax)).all()
    assert fake_tensor_quant(x, amax)[0].tolist() == [0.0, 0.0]


def test_gradient_is_clipped_straight_through() -> None:
    x = torch.tensor([-2.0, -0.5, 0.5, 1.0, 3.0], requires_grad=True)
    fake_tensor_quant(x, 1.0).sum().backward()
    assert x.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]
    x2 = x.detach().clone().requires_grad_(True)
    q, _ = tensor_quant(x2, 1.0)
    q.sum().backward()
    assert x2.grad.tolist() == [0.0, 1.0, 1.0, 1.0, 0.0]


def test_half_inputs_keep_dtype() -> None:
    x = torch.tensor([0.1, -0.7, 0.33], dtype=torch.float16)
    y = fake_tensor_quant(x, torch.tensor(1.0))
    assert y.dtype == torch.float16
    assert torch.equal(y, fake_tensor_quant(x.float(), 1.0).half())


def test_errors() -> None:
    x = torch.tensor([0.5, -0.5])
    with pytest.raises(DataError, match="amax must be >= 0"):
        tensor_quant(x, -1.0)
    with pytest.raises(DataError, match="NaN or Inf"):
        fake_tensor_quant(x, float("nan"))
    with pytest.raises(DataError, match="negative values in unsigned"):
        tensor_quant(x, 1.0, unsigned=True)
    with pytest.raises(ConfigError, match="num_bits"):
        tensor_quant(x, 1.0, num_bits=1)
    with pytest.raises(DataError, match="floating"):
        tensor_quant(torch.tensor([1, 2]), 1.0)
    with pytest.raises(DataError, match="empty"):
        tensor_quant(x, torch.empty(0))


def test_non_finite_inputs() -> None:
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.5])
    q, _ = tensor_quant(x, 1.0)
    assert q[:2].tolist() == [127.0, -127.0] and torch.isnan(q[2]) and q[3].item() == 64.0
