"""LSQ / LSQ+ gradients: bit-exact with torch.ao.quantization._LearnableFakeQuantize."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization._learnable_fake_quantize import _LearnableFakeQuantize
from torch.ao.quantization.observer import MinMaxObserver, PerChannelMinMaxObserver

from netquant.core.ops import GradMode, default_lsq_grad_scale, fake_quantize
from netquant.core.spec import Granularity, QuantSpec, RoundingPolicy


def _torch_learnable(spec: QuantSpec, n_channels: int | None, axis: int, grad_scaling: bool) -> _LearnableFakeQuantize:
    kw = {"quant_min": spec.qmin, "quant_max": spec.qmax, "use_grad_scaling": grad_scaling, "dtype": torch.qint32}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if n_channels is None:
            fq = _LearnableFakeQuantize(MinMaxObserver, qscheme=torch.per_tensor_affine, **kw)
        else:
            fq = _LearnableFakeQuantize(PerChannelMinMaxObserver, channel_len=n_channels, ch_axis=axis,
                                        qscheme=torch.per_channel_affine, **kw)
    fq.toggle_observer_update(False)
    fq.toggle_qparam_learning(True)
    return fq


@st.composite
def lsq_cases(draw: st.DrawFn, per_channel: bool):
    bits = draw(st.integers(2, 16))
    signed = draw(st.booleans())
    # torch's per-channel learnable backward returns a wrongly shaped scale gradient for 1-D inputs
    ndim = draw(st.integers(2 if per_channel else 1, 4))
    shape = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    axis = draw(st.integers(0, ndim - 1))
    seed = draw(st.integers(0, 2**31 - 1))
    grad_scaling = draw(st.booleans())
    kw: dict = {"granularity": Granularity.PER_CHANNEL, "axis": axis} if per_channel else {}
    spec = QuantSpec(bits=bits, signed=signed, symmetric=False, **kw)
    gen = torch.Generator().manual_seed(seed)
    n = shape[axis] if per_channel else 1
    scale = torch.exp(torch.empty(n).uniform_(math.log(1e-3), math.log(2.0), generator=gen))
    # torch's per-tensor backward turns the zero point into int(z + 0.5) (truncation), which differs from
    # its forward round(z) for negative z: compare on non-negative integer zero points.
    zp = torch.randint(max(spec.qmin, 0), spec.qmax + 1, (n,), generator=gen).float()
    view = [1] * ndim
    view[axis] = n
    span = spec.qmax - spec.qmin
    codes = torch.rand(shape, generator=gen) * span * 1.4 + spec.qmin - 0.2 * span - zp.reshape(view)
    ties = torch.rand(shape, generator=gen) < 0.3  # exact ties of x/s where the scale is a power of two
    pow2 = draw(st.booleans())
    if pow2:
        scale = torch.exp2(torch.round(torch.log2(scale)))
        codes = torch.where(ties, torch.floor(codes) + 0.5, codes)
    x = codes * scale.reshape(view)
    dy = torch.randn(shape, generator=gen)
    return spec, x, scale, zp, dy, grad_scaling


def _compare(spec: QuantSpec, x, scale, zp, dy, grad_scaling: bool, per_channel: bool) -> None:
    axis = spec.axis if per_channel else 0
    fq = _torch_learnable(spec, scale.numel() if per_channel else None, axis, grad_scaling)
    fq.scale.data = scale.clone()
    fq.zero_point.data = zp.clone()
    xa = x.clone().requires_grad_(True)
    ya = fq(xa)
    ya.backward(dy)

    xb = x.clone().requires_grad_(True)
    sb = scale.clone().requires_grad_(True)
    zb = zp.clone().requires_grad_(True)
    yb = fake_quantize(xb, sb, zb, spec, grad_mode=GradMode.LSQ,
                       lsq_grad_scale=None if grad_scaling else 1.0)
    yb.backward(dy)
    assert torch.equal(ya, yb)
    assert torch.equal(xa.grad, xb.grad)
    assert torch.equal(fq.scale.grad, sb.grad)
    assert torch.equal(fq.zero_point.grad, zb.grad)


@settings(max_examples=50, deadline=None)
@given(case=lsq_cases(per_channel=False))
def test_lsq_per_tensor_bit_exact_with_torch(case) -> None:
    _compare(*case, per_channel=False)


@settings(max_examples=50, deadline=None)
@given(case=lsq_cases(per_channel=True))
def test_lsq_per_channel_bit_exact_with_torch(case) -> None:
    _compare(*case, per_channel=True)


def test_grad_scale_is_one_over_sqrt_numel_times_qmax() -> None:
    x = torch.zeros(3, 5)
    assert default_lsq_grad_scale(x, QuantSpec.int8()) == 1.0 / math.sqrt(15 * 127)
    assert default_lsq_grad_scale(x, QuantSpec.uint8_affine()) == 1.0 / math.sqrt(15 * 255)
    assert default_lsq_grad_scale(x, QuantSpec(bits=4)) == 1.0 / math.sqrt(15 * 7)


def test_lsq_hand_computed_gradients() -> None:
    # s = 0.5, z = 0, int4 [-8, 7], g = 1: inside ds = (x' - x) / s; below: qmin - z; above: qmax - z.
    x = torch.tensor([0.3, -10.0, 10.0, 1.0], requires_grad=True)
    s = torch.tensor(0.5, requires_grad=True)
    z = torch.tensor(0.0, requires_grad=True)
    y = fake_quantize(x, s, z, QuantSpec(bits=4, symmetric=False), grad_mode=GradMode.LSQ, lsq_grad_scale=1.0)
    y.sum().backward()
    assert y.tolist() == [0.5, -4.0, 3.5, 1.0]
    assert x.grad.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert s.grad.item() == pytest.approx((0.5 - 0.3) / 0.5 + (-8) + 7 + 0.0)
    assert z.grad.item() == pytest.approx(-0.5 * 2)


def test_lsq_integer_zero_point_gets_no_gradient() -> None:
    """An integer zero point is a constant: no gradient reaches it, x and scale get torch's LSQ gradients."""
    x = torch.randn(10, generator=torch.Generator().manual_seed(0)) * 3
    x[0], x[1] = 10.0, -10.0  # one element above qmax, one below qmin
    xs, s = x.clone().requires_grad_(True), torch.tensor(0.05, requires_grad=True)
    zp = torch.tensor(3, dtype=torch.int32)
    spec = QuantSpec.int8(symmetric=False)
    y = fake_quantize(xs, s, zp, spec, grad_mode=GradMode.LSQ)
    y.sum().backward()
    assert zp.grad is None and not zp.requires_grad
    # reference: torch's learnable kernel with the same zero point held constant (not a leaf needing grad)
    xr, sr = x.clone().requires_grad_(True), torch.tensor([0.05], requires_grad=True)
    yr = torch._fake_quantize_learnable_per_tensor_affine(xr, sr, torch.tensor([3.0]), -128, 127,
                                                          1.0 / math.sqrt(10 * 127))
    yr.sum().backward()
    assert torch.equal(y, yr)
    assert torch.equal(xs.grad, xr.grad)
    assert xs.grad[:2].tolist() == [0.0, 0.0] and bool((xs.grad[2:] == 1.0).all())
    assert s.grad.item() == sr.grad.item()
    # the clipped elements contribute (qmax - z) + (qmin - z) = 124 - 131 = -7 before the gradient scale
    inside = x[2:]
    codes = torch.clamp(torch.round(inside / 0.05) + 3, -128, 127)
    hand = ((codes - 3) * 0.05 - inside).sum() / 0.05 + (127 - 3) + (-128 - 3)
    assert s.grad.item() == pytest.approx(float(hand) / math.sqrt(10 * 127), rel=1e-5)


def test_lsq_plus_float_zero_point_gradient_is_zero_inside_and_minus_s_g_outside() -> None:
    """LSQ+: a floating zero point gets dL/dz = 0 inside the grid and -dy * s * g where x is clipped."""
    x = torch.tensor([0.3, -10.0, 10.0, 1.0, -0.2])
    s = torch.tensor(0.5, requires_grad=True)
    z = torch.tensor(1.0, requires_grad=True)
    dy = torch.tensor([1.0, 2.0, -3.0, 4.0, 5.0])
    y = fake_quantize(x.clone().requires_grad_(True), s, z, QuantSpec(bits=4, symmetric=False),
                      grad_mode=GradMode.LSQ, lsq_grad_scale=0.25)
    y.backward(dy)
    # clipped: x=-10 (dy 2) and x=10 (dy -3): dz = -(2 + -3) * 0.5 * 0.25
    assert z.grad.item() == -(2.0 - 3.0) * 0.5 * 0.25


def test_lsq_per_group_equals_per_channel_on_reshaped_tensor() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(3, 12, generator=gen) * 2
    dy = torch.randn(3, 12, generator=gen)
    s = torch.rand(3, 4, generator=gen) * 0.2 + 0.05
    z = torch.randint(-8, 8, (3, 4), generator=gen).float()
    g = QuantSpec(bits=4, symmetric=False, granularity=Granularity.PER_GROUP, axis=1, group_size=3)
    c = QuantSpec(bits=4, symmetric=False, granularity=Granularity.PER_CHANNEL, axis=0)
    grads = []
    for spec, xx, ss, zz, dd in [(g, x, s, z, dy), (c, x.reshape(12, 3), s.reshape(12), z.reshape(12),
                                                     dy.reshape(12, 3))]:
        xr, sr, zr = xx.clone().requires_grad_(), ss.clone().requires_grad_(), zz.clone().requires_grad_()
        y = fake_quantize(xr, sr, zr, spec, grad_mode=GradMode.LSQ, lsq_grad_scale=0.1)
        y.backward(dd)
        grads.append((y.reshape(3, 12), xr.grad.reshape(3, 12), sr.grad.reshape(3, 4), zr.grad.reshape(3, 4)))
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_lsq_other_policy_and_fp8_have_sane_gradients() -> None:
    x = torch.tensor([0.25, 0.75, 100.0], requires_grad=True)
    s = torch.tensor(0.5, requires_grad=True)
    y = fake_quantize(x, s, 0, QuantSpec.int8(rounding=RoundingPolicy.ROUND_HALF_UP), grad_mode=GradMode.LSQ,
                      lsq_grad_scale=1.0)
    y.sum().backward()
    assert y.tolist() == [0.5, 1.0, 63.5]
    assert s.grad.item() == pytest.approx((0.5 - 0.25) / 0.5 + (1.0 - 0.75) / 0.5 + 127)
    xf = torch.tensor([1.0, 1000.0], requires_grad=True)
    sf = torch.tensor(1.0, requires_grad=True)
    yf = fake_quantize(xf, sf, None, QuantSpec.fp8_e4m3(), grad_mode=GradMode.LSQ, lsq_grad_scale=1.0)
    yf.sum().backward()
    assert yf.tolist() == [1.0, 448.0] and xf.grad.tolist() == [1.0, 0.0] and sf.grad.item() == 448.0


def test_lsq_per_channel_1d_gives_per_channel_gradients() -> None:
    x = torch.tensor([0.3, -5.0, 0.7], requires_grad=True)
    s = torch.tensor([0.1, 0.1, 0.2], requires_grad=True)
    spec = QuantSpec(bits=4, granularity=Granularity.PER_CHANNEL, axis=0)
    fake_quantize(x, s, None, spec, grad_mode=GradMode.LSQ, lsq_grad_scale=1.0).sum().backward()
    assert s.grad.shape == (3,)
    assert s.grad.tolist() == pytest.approx([0.0, -8.0, (0.8 - 0.7) / 0.2], abs=1e-6)


def test_an_empty_input_keeps_learned_params_in_the_graph_with_zero_gradient() -> None:
    spec = QuantSpec(bits=8, signed=True, granularity=Granularity.PER_TENSOR)
    scale = torch.tensor([0.1], requires_grad=True)
    zero_point = torch.tensor([0.0], requires_grad=True)
    out = fake_quantize(torch.empty(0, 3), scale, zero_point, spec, GradMode.LSQ)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert scale.grad is not None and zero_point.grad is not None
    assert float(scale.grad.abs().sum()) == 0.0 and float(zero_point.grad.abs().sum()) == 0.0
