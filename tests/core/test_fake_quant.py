"""quantize / dequantize / fake_quantize: bit-exact with torch's kernels, FP8 casts, policies, groups."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import netquant.core.ops as ops
from netquant.core.ops import GradMode, dequantize, fake_quantize, param_shape, quantize
from netquant.core.rounding import round_with_policy
from netquant.core.spec import Granularity, QuantSpec, RoundingPolicy
from netquant.errors import ConfigError, DataError

pytestmark = pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")


@pytest.fixture(params=["torch-kernel", "own-kernel"])
def dispatch(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test through torch's fused kernel (the default) and through our own kernel."""
    monkeypatch.setattr(ops, "_DISPATCH_TO_TORCH", request.param == "torch-kernel")
    return request.param


# ------------------------------------------------------------------------------------------------
# randomized cases
# ------------------------------------------------------------------------------------------------
@st.composite
def int_cases(draw: st.DrawFn, per_channel: bool) -> tuple[QuantSpec, torch.Tensor, torch.Tensor, torch.Tensor]:
    bits = draw(st.integers(2, 16))
    signed = draw(st.booleans())
    narrow = draw(st.booleans())
    ndim = draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    axis = draw(st.integers(-ndim, ndim - 1))
    seed = draw(st.integers(0, 2**31 - 1))
    kw: dict = {"granularity": Granularity.PER_CHANNEL, "axis": axis} if per_channel else {}
    spec = QuantSpec(bits=bits, signed=signed, symmetric=False, narrow_range=narrow, **kw)
    gen = torch.Generator().manual_seed(seed)
    n = shape[axis] if per_channel else 1
    scale = torch.exp(torch.empty(n).uniform_(math.log(1e-4), math.log(10.0), generator=gen))
    zp = torch.randint(spec.qmin, spec.qmax + 1, (n,), generator=gen, dtype=torch.int32)
    view = [1] * ndim
    if per_channel:
        view[axis] = n
    s_b, z_b = scale.reshape(view), zp.reshape(view).float()
    span = spec.qmax - spec.qmin
    # codes spread over 1.4x the range (some clip), and a third of them exact ties k + 0.5
    codes = torch.rand(shape, generator=gen) * span * 1.4 + spec.qmin - 0.2 * span - z_b
    ties = torch.rand(shape, generator=gen) < 0.33
    codes = torch.where(ties, torch.floor(codes) + 0.5, codes)
    x = (codes * s_b).to(torch.float32)
    if not per_channel:
        scale, zp = scale.reshape(()), zp.reshape(())
    return spec, x, scale, zp


def _grad(fn, x: torch.Tensor, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = fn(x)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed))
    y.backward(dy)
    return y.detach(), x.grad


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=int_cases(per_channel=False))
def test_per_tensor_matches_torch_values_and_grads(dispatch: str, case) -> None:
    spec, x, scale, zp = case
    ours, g_ours = _grad(lambda t: fake_quantize(t, scale, zp, spec), x)
    ref, g_ref = _grad(lambda t: torch.fake_quantize_per_tensor_affine(t, scale, zp, spec.qmin, spec.qmax), x)
    assert torch.equal(ours, ref)
    assert torch.equal(g_ours, g_ref)


@settings(max_examples=60, deadline=None)
@given(case=int_cases(per_channel=True))
def test_per_channel_matches_torch_values_and_grads(case) -> None:
    spec, x, scale, zp = case
    axis = spec.axis % x.ndim
    ours, g_ours = _grad(lambda t: fake_quantize(t, scale, zp, spec), x)
    ref, g_ref = _grad(lambda t: torch.fake_quantize_per_channel_affine(t, scale, zp, axis, spec.qmin, spec.qmax), x)
    assert torch.equal(ours, ref)
    assert torch.equal(g_ours, g_ref)


TORCH_QDTYPES = {(True, 8): torch.qint8, (False, 8): torch.quint8, (True, 32): torch.qint32}


@settings(max_examples=60, deadline=None)
@given(case=int_cases(per_channel=False), kind=st.sampled_from(sorted(TORCH_QDTYPES, key=str)))
def test_quantize_matches_torch_int_repr(case, kind: tuple[bool, int]) -> None:
    _, x, scale, _ = case
    signed, bits = kind
    spec = QuantSpec(bits=bits, signed=signed, symmetric=False)
    gen = torch.Generator().manual_seed(int(x.numel() * 1000 + bits))
    zp = int(torch.randint(max(spec.qmin, -1000), min(spec.qmax, 1000) + 1, (), generator=gen).item())
    xs = x * 300  # push codes outside the 8-bit range too
    qt = torch.quantize_per_tensor(xs, scale.item(), zp, TORCH_QDTYPES[kind])
    q = quantize(xs, scale, zp, spec)
    assert q.dtype == qt.int_repr().dtype
    # torch's fbgemm quantizer rounds x/s + z, we (and torch's fake-quant, and ONNX) round x/s, then
    # add z: the two differ only on exact ties (see test_quantize_rounds_before_adding_zero_point).
    t = xs * torch.reciprocal(scale)
    tz = t + zp
    tie = (t - t.floor() == 0.5) | (tz - tz.floor() == 0.5)
    # beyond 2^24 torch's float32 sum x/s + z is inexact (qint32 only); we add z exactly
    keep = ~tie & (tz.abs() < 2**24)
    assert torch.equal(q[keep], qt.int_repr()[keep])
    assert torch.equal(dequantize(q, scale, zp, spec)[keep], qt.dequantize()[keep])
    if zp % 2 == 0 and bits == 8:  # even zero point: ties agree too
        assert torch.equal(q, qt.int_repr())


def test_quantize_rounds_before_adding_zero_point() -> None:
    """Ties with an odd zero point: round(x/s) + z (ONNX QuantizeLinear, torch fake-quant) is the contract."""
    x = torch.tensor([0.5, 1.5, 2.5, -0.5])
    spec = QuantSpec.int8(symmetric=False)
    ours = quantize(x, 1.0, 1, spec)
    assert ours.tolist() == [1, 3, 3, 1]
    assert torch.equal(fake_quantize(x, 1.0, 1, spec), torch.fake_quantize_per_tensor_affine(x, 1.0, 1, -128, 127))
    assert torch.equal(dequantize(ours, 1.0, 1, spec), fake_quantize(x, 1.0, 1, spec))
    # torch.quantize_per_tensor in torch's 2.13 CPU wheel (fbgemm, legacy rounding) rounds x/s + z instead; other
    # builds (torch 2.11's CUDA wheel on an AVX-512 Xeon) round first, as ONNX does
    from netquant.core.qtensor import torch_adds_zero_point_first

    theirs = torch.quantize_per_tensor(x, 1.0, 1, torch.qint8).int_repr().tolist()
    assert theirs == ([2, 2, 4, 0] if torch_adds_zero_point_first(False) else [1, 3, 3, 1])


@settings(max_examples=40, deadline=None)
@given(case=int_cases(per_channel=True), signed=st.booleans())
def test_quantize_per_channel_matches_torch(case, signed: bool) -> None:
    _, x, scale, _ = case
    spec = QuantSpec(bits=8, signed=signed, symmetric=False, granularity=Granularity.PER_CHANNEL,
                     axis=case[0].axis)
    gen = torch.Generator().manual_seed(x.numel())
    zp = torch.randint(spec.qmin, spec.qmax + 1, scale.shape, dtype=torch.int64, generator=gen)
    axis = spec.axis % x.ndim
    xs = x * 50
    qt = torch.quantize_per_channel(xs, scale.double(), zp, axis, torch.qint8 if signed else torch.quint8)
    q = quantize(xs, scale, zp, spec)
    view = [1] * x.ndim
    view[axis] = -1
    t = xs * torch.reciprocal(scale).reshape(view)
    tz = t + zp.reshape(view)
    tie = (t - t.floor() == 0.5) | (tz - tz.floor() == 0.5)  # torch rounds x/s + z here (see above)
    assert torch.equal(q[~tie], qt.int_repr()[~tie])
    assert torch.equal(dequantize(q, scale, zp, spec)[~tie], qt.dequantize()[~tie])


# ------------------------------------------------------------------------------------------------
# rounding policies, per-group, quantize/dequantize consistency
# ------------------------------------------------------------------------------------------------
def _reference_fake(x: torch.Tensor, s: torch.Tensor, z: torch.Tensor, spec: QuantSpec) -> torch.Tensor:
    """clamp(round(x * (1/s)) + z, qmin, qmax) - z) * s written out plainly (NaN-free inputs)."""
    codes = round_with_policy(x * torch.reciprocal(s), spec.rounding) + z
    return (codes.clamp(spec.qmin, spec.qmax) - z) * s


@pytest.mark.parametrize("policy", list(RoundingPolicy))
@pytest.mark.parametrize("granularity", [Granularity.PER_TENSOR, Granularity.PER_CHANNEL])
def test_every_policy_on_ties(policy: RoundingPolicy, granularity: Granularity) -> None:
    per_channel = granularity is Granularity.PER_CHANNEL
    spec = QuantSpec(bits=4, signed=True, symmetric=False, rounding=policy,
                     granularity=granularity, axis=0 if per_channel else None)
    s = torch.tensor([0.25, 0.5]) if per_channel else torch.tensor(0.25)  # powers of two: x/s exact
    z = torch.tensor([1, -2], dtype=torch.int32) if per_channel else torch.tensor(1, dtype=torch.int32)
    ties = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5, 7.5, -9.5, 0.3, -0.7])
    x = (ties * (s.reshape(-1, 1) if per_channel else s)).reshape(2, -1) if per_channel else ties * s
    sb, zb = (s.reshape(-1, 1), z.reshape(-1, 1).float()) if per_channel else (s, z.float())
    want = _reference_fake(x, sb, zb, spec)
    got = fake_quantize(x, s, z, spec)
    assert torch.equal(got, want)
    q = quantize(x, s, z, spec)
    assert torch.equal(dequantize(q, s, z, spec), want)


def test_policy_table_through_fake_quantize() -> None:
    ties = torch.tensor([-2.5, -1.5, -0.5, 0.5, 1.5, 2.5])
    expect = {
        RoundingPolicy.ROUND_HALF_EVEN: [-2, -2, 0, 0, 2, 2],
        RoundingPolicy.ROUND_HALF_UP: [-2, -1, 0, 1, 2, 3],
        RoundingPolicy.ROUND_HALF_DOWN: [-3, -2, -1, 0, 1, 2],
        RoundingPolicy.ROUND_HALF_TOWARDS_ZERO: [-2, -1, 0, 0, 1, 2],
        RoundingPolicy.ROUND_HALF_FAR_FROM_ZERO: [-3, -2, -1, 1, 2, 3],
        RoundingPolicy.ROUND_TO_NEAR_INT: [-3, -2, -1, 1, 2, 3],
        RoundingPolicy.ROUND_UP: [-2, -1, 0, 1, 2, 3],
    }
    for policy, codes in expect.items():
        spec = QuantSpec.int8(rounding=policy)
        assert quantize(ties, 1.0, 0, spec).tolist() == codes
        assert fake_quantize(ties * 0.5, 0.5, 0, spec).tolist() == [c * 0.5 for c in codes]


@pytest.mark.parametrize("length,group", [(12, 4), (10, 4), (7, 7), (5, 1)])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_per_group_equals_per_tensor_on_each_block(length: int, group: int, axis: int) -> None:
    gen = torch.Generator().manual_seed(length * 31 + group)
    shape = [3, length, 2] if axis in (1,) else ([length, 3] if axis == 0 else [3, 2, length])
    x = torch.randn(shape, generator=gen) * 3
    spec = QuantSpec(bits=4, signed=True, symmetric=False, granularity=Granularity.PER_GROUP,
                     axis=axis, group_size=group)
    pshape = param_shape(x.shape, spec)
    ax = axis % x.ndim
    assert pshape[ax] == -(-length // group)
    scale = torch.rand(pshape, generator=gen) * 0.5 + 0.05
    zp = torch.randint(-8, 8, pshape, generator=gen, dtype=torch.int32)
    got = fake_quantize(x, scale, zp, spec)
    q = quantize(x, scale, zp, spec)
    for g in range(pshape[ax]):
        block = x.narrow(ax, g * group, min(group, length - g * group))
        s_g = scale.narrow(ax, g, 1)
        z_g = zp.narrow(ax, g, 1).float()
        want = (torch.round(block * torch.reciprocal(s_g)).add(z_g).clamp(-8, 7) - z_g) * s_g
        assert torch.equal(got.narrow(ax, g * group, block.shape[ax]), want)
    assert torch.equal(dequantize(q, scale, zp, spec), got)


def test_per_group_accepts_flat_params_for_1d() -> None:
    spec = QuantSpec.int4_per_group(group_size=3, axis=0)
    x = torch.linspace(-2, 2, 9)
    s = torch.tensor([0.1, 0.2, 0.3])
    want = torch.cat([fake_quantize(x[i * 3:(i + 1) * 3], s[i], 0, QuantSpec(bits=4)) for i in range(3)])
    assert torch.equal(fake_quantize(x, s, None, spec), want)


@pytest.mark.parametrize("policy", list(RoundingPolicy))
def test_dequantize_of_quantize_is_fake_quantize(policy: RoundingPolicy) -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4, 6, generator=gen) * 4
    for spec, s, z in [
        (QuantSpec(bits=3, signed=False, symmetric=False, rounding=policy), torch.tensor(0.37), torch.tensor(2)),
        (QuantSpec(bits=8, granularity=Granularity.PER_CHANNEL, axis=1, rounding=policy, symmetric=False),
         torch.rand(6, generator=gen) + 0.01, torch.randint(-128, 128, (6,), generator=gen)),
        (QuantSpec(bits=16, signed=False, symmetric=False, rounding=policy), torch.tensor(1e-4), torch.tensor(30000)),
    ]:
        q = quantize(x, s, z, spec)
        assert q.dtype == spec.storage_dtype
        assert int(q.min()) >= spec.qmin and int(q.max()) <= spec.qmax
        assert torch.equal(dequantize(q, s, z, spec), fake_quantize(x, s, z, spec))


# ------------------------------------------------------------------------------------------------
# FP8
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", [QuantSpec.fp8_e4m3(), QuantSpec.fp8_e5m2()])
def test_fp8_equals_cast_after_scaling(spec: QuantSpec) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 33, generator=gen) * torch.logspace(-6, 3, 33)  # many binades, some saturate
    s = torch.tensor(0.75)
    fp8 = spec.storage_dtype
    want = (x / s).clamp(-spec.fp_max, spec.fp_max).to(fp8).to(torch.float32) * s
    assert torch.equal(fake_quantize(x, s, None, spec), want)
    q = quantize(x, s, None, spec)
    assert q.dtype == fp8
    assert torch.equal(q.view(torch.uint8), (x / s).clamp(-spec.fp_max, spec.fp_max).to(fp8).view(torch.uint8))
    assert torch.equal(dequantize(q, s, None, spec), want)


@pytest.mark.parametrize("spec", [QuantSpec.fp8_e4m3(granularity=Granularity.PER_CHANNEL, axis=0),
                                  QuantSpec.fp8_e5m2(granularity=Granularity.PER_CHANNEL, axis=0)])
def test_fp8_per_channel_and_grads(spec: QuantSpec) -> None:
    x = torch.tensor([[1.0, -500.0, 0.001, 460.0], [3e4, -7e4, 2.0, 0.5]])
    s = torch.tensor([1.0, 1.0])
    y, g = _grad(lambda t: fake_quantize(t, s, None, spec), x)
    want = x.clamp(-spec.fp_max, spec.fp_max).to(spec.storage_dtype).float()
    assert torch.equal(y, want)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(g, dy * (x.abs() <= spec.fp_max))


def test_fp8_non_finite() -> None:
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), 1.0])
    y = fake_quantize(x, 2.0, None, QuantSpec.fp8_e4m3())
    assert y[:2].tolist() == [896.0, -896.0] and torch.isnan(y[2]) and y[3].item() == 1.0


# ------------------------------------------------------------------------------------------------
# gradient modes, dtypes, non-finite inputs, errors
# ------------------------------------------------------------------------------------------------
def test_ste_passes_gradient_everywhere() -> None:
    x = torch.tensor([-100.0, -0.3, 0.3, 100.0, float("inf")])
    y, g = _grad(lambda t: fake_quantize(t, 0.1, 0, QuantSpec.int8(), grad_mode=GradMode.STE), x)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(0))
    assert torch.equal(g, dy)
    y2, g2 = _grad(lambda t: fake_quantize(t, 0.1, 0, QuantSpec.int8()), x)
    assert torch.equal(y, y2) and torch.equal(g2, dy * torch.tensor([0.0, 1, 1, 0, 0]))


@pytest.mark.parametrize("policy", [RoundingPolicy.ROUND_HALF_EVEN, RoundingPolicy.ROUND_HALF_UP])
def test_non_finite_int_inputs_documented_behaviour(dispatch: str, policy: RoundingPolicy) -> None:
    spec = QuantSpec.int8(rounding=policy)
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, 0.3])
    y, g = _grad(lambda t: fake_quantize(t, 0.1, 3, spec), x)
    # +Inf -> qmax, -Inf -> qmin, NaN -> qmin (torch.fake_quantize_per_tensor_affine's convention)
    want = (torch.tensor([-128.0, 127, -128, 127, -128, 3 + 3]) - 3) * torch.tensor(0.1)
    assert torch.equal(y, want)
    assert g[:5].eq(0).all() and g[5] != 0
    assert quantize(x, 0.1, 3, spec).tolist() == [-128, 127, -128, 127, -128, 6]
    pc = QuantSpec.int8_per_channel(axis=0, rounding=policy)
    assert torch.equal(fake_quantize(x.view(2, 3), torch.tensor([0.1, 0.1]), torch.tensor([3, 3]), pc),
                       want.view(2, 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_float_dtypes_compute_in_float32(dtype: torch.dtype) -> None:
    x = (torch.randn(50, generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    spec = QuantSpec.uint8_affine()
    y = fake_quantize(x, 0.05, 100, spec)
    assert y.dtype == dtype
    assert torch.equal(y, fake_quantize(x.float(), 0.05, 100, spec).to(dtype))
    xr = x.clone().requires_grad_(True)
    fake_quantize(xr, 0.05, 100, spec).sum().backward()
    assert xr.grad.dtype == dtype


def test_empty_and_scalar_inputs() -> None:
    assert fake_quantize(torch.empty(0, 3), 0.1, 0, QuantSpec.int8()).shape == (0, 3)
    assert fake_quantize(torch.tensor(0.26), 0.1, 0, QuantSpec.int8(rounding=RoundingPolicy.ROUND_UP)).item() == \
        pytest.approx(0.3)


@pytest.mark.parametrize("scale", [0.0, -0.1, float("nan"), float("inf")])
def test_bad_scale_raises(scale: float) -> None:
    with pytest.raises(DataError, match="scale must be finite and > 0"):
        fake_quantize(torch.ones(3), scale, 0, QuantSpec.int8())
    with pytest.raises(DataError, match="scale must be finite and > 0"):
        quantize(torch.ones(3), scale, 0, QuantSpec.int8())


def test_bad_params_and_inputs_raise() -> None:
    spec = QuantSpec.int8_per_channel(axis=1)
    x = torch.ones(2, 3)
    with pytest.raises(DataError, match=r"per_channel scale has shape \(2,\).*needs \(3,\)"):
        fake_quantize(x, torch.ones(2), None, spec)
    with pytest.raises(ConfigError, match="axis=3 is out of range"):
        fake_quantize(x, torch.ones(3), None, QuantSpec.int8_per_channel(axis=3))
    with pytest.raises(DataError, match="zero_point must lie in"):
        fake_quantize(x, 0.1, 300, QuantSpec.int8())
    with pytest.raises(DataError, match="per-tensor scale must have one element"):
        fake_quantize(x, torch.ones(2), 0, QuantSpec.int8())
    with pytest.raises(DataError, match="floating tensor"):
        fake_quantize(torch.ones(3, dtype=torch.int32), 0.1, 0, QuantSpec.int8())
    with pytest.raises(DataError, match="torch.Tensor"):
        quantize([1.0, 2.0], 0.1, 0, QuantSpec.int8())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="GradMode"):
        fake_quantize(x, 0.1, 0, QuantSpec.int8(), grad_mode="lsq")  # type: ignore[arg-type]
    with pytest.raises(DataError, match="NaN or Inf"):
        fake_quantize(x, 0.1, torch.tensor(float("nan")), QuantSpec.int8())


def test_int32_bias_spec_matches_torch_qint32() -> None:
    spec = QuantSpec(bits=32)
    x = torch.tensor([1e3, -2.5e3, 0.123456, 5e6, -float("inf")])
    q = quantize(x, 1e-4, 0, spec)
    ref = torch.quantize_per_tensor(x, 1e-4, 0, torch.qint32)
    assert q.dtype == torch.int32 and torch.equal(q, ref.int_repr())
    assert torch.equal(dequantize(q, 1e-4, 0, spec), ref.dequantize())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), e5=st.booleans(), per_channel=st.booleans(),
       log_scale=st.floats(-20, 20))
def test_fp8_randomized_equals_cast(seed: int, e5: bool, per_channel: bool, log_scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    kw: dict = {"granularity": Granularity.PER_CHANNEL, "axis": 1} if per_channel else {}
    spec = QuantSpec.fp8_e5m2(**kw) if e5 else QuantSpec.fp8_e4m3(**kw)
    x = torch.randn(5, 7, generator=gen) * torch.exp(torch.empty(5, 7).uniform_(-12, 12, generator=gen))
    s = torch.exp(torch.full((7,) if per_channel else (), log_scale) + torch.rand(7 if per_channel else (),
                                                                                    generator=gen))
    scaled = x / (s.reshape(1, 7) if per_channel else s)
    cast = scaled.clamp(-spec.fp_max, spec.fp_max).to(spec.storage_dtype)
    want = cast.to(torch.float32) * (s.reshape(1, 7) if per_channel else s)
    assert torch.equal(fake_quantize(x, s, None, spec), want)
    assert torch.equal(quantize(x, s, None, spec).view(torch.uint8), cast.view(torch.uint8))


def test_zero_range_tensor_round_trips_to_zero() -> None:
    from netquant.core.qparams import choose_qparams

    x = torch.zeros(4, 3)
    for spec in [QuantSpec.int8(), QuantSpec.uint8_affine(), QuantSpec.fp8_e4m3(),
                 QuantSpec.int8_per_channel(axis=1)]:
        lo = x.amin(0) if spec.granularity is Granularity.PER_CHANNEL else x.min()
        hi = x.amax(0) if spec.granularity is Granularity.PER_CHANNEL else x.max()
        qp = choose_qparams(lo, hi, spec)
        y = fake_quantize(x, qp.scale, qp.zero_point, spec)
        assert torch.equal(y, x)
        assert torch.equal(dequantize(quantize(x, qp.scale, qp.zero_point, spec), qp.scale, qp.zero_point, spec), x)


def test_param_shape() -> None:
    assert param_shape((4, 6), QuantSpec.int8()) == ()
    assert param_shape((4, 6), QuantSpec.int8_per_channel(axis=1)) == (6,)
    assert param_shape((4, 6), QuantSpec.int8_per_channel(axis=-2)) == (4,)
    assert param_shape((4, 10), QuantSpec.int4_per_group(group_size=4, axis=1)) == (4, 3)
