"""choose_qparams: bit-exact with torch.ao observers' formulas, pow2, FP8, zero range, bad ranges."""

from __future__ import annotations

import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.ao.quantization.observer import MinMaxObserver

from netquant.core.qparams import EPS, TINY, QParams, choose_qparams
from netquant.core.spec import QuantSpec, ScaleConstraint
from netquant.errors import CalibrationError, DataError


def _torch_ao_qparams(lo: torch.Tensor, hi: torch.Tensor, spec: QuantSpec) -> tuple[torch.Tensor, torch.Tensor]:
    scheme = torch.per_tensor_symmetric if spec.symmetric else torch.per_tensor_affine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if not spec.signed and spec.qmin == 0 and spec.qmax == 255:
            obs = MinMaxObserver(dtype=torch.quint8, qscheme=scheme)
        else:
            obs = MinMaxObserver(dtype=torch.qint32, qscheme=scheme, quant_min=spec.qmin, quant_max=spec.qmax)
    return obs._calculate_qparams(lo, hi)


range_values = st.floats(-1e4, 1e4, allow_nan=False, width=32)


@st.composite
def int_specs(draw: st.DrawFn) -> QuantSpec:
    bits = draw(st.integers(2, 16))
    signed = draw(st.booleans())
    symmetric = draw(st.booleans())
    if symmetric and not signed:  # torch.ao's unsigned symmetric zero point is defined for uint8 only
        bits = 8
    narrow = draw(st.booleans()) if not (symmetric and not signed) else False
    return QuantSpec(bits=bits, signed=signed, symmetric=symmetric, narrow_range=narrow)


@settings(max_examples=80, deadline=None)
@given(spec=int_specs(), pairs=st.lists(st.tuples(range_values, range_values), min_size=1, max_size=8))
def test_matches_torch_ao_observer_formulas(spec: QuantSpec, pairs: list[tuple[float, float]]) -> None:
    lo = torch.tensor([min(a, b) for a, b in pairs], dtype=torch.float32)
    hi = torch.tensor([max(a, b) for a, b in pairs], dtype=torch.float32)
    qp = choose_qparams(lo, hi, spec)
    want_scale, want_zp = _torch_ao_qparams(lo, hi, spec)
    # torch.ao floors every scale at eps; netquant only zero ranges (tiny ones keep their levels, see below)
    ao = want_scale > EPS
    assert torch.equal(qp.scale[ao], want_scale[ao])
    assert torch.equal(qp.zero_point.to(torch.int64)[ao], want_zp.to(torch.int64)[ao])
    assert qp.scale.dtype == torch.float32 and qp.zero_point.dtype == torch.int32
    assert bool((qp.scale[~ao] <= EPS).all()) and bool((qp.scale >= TINY).all())


def test_affine_uint8_hand_computed() -> None:
    qp = choose_qparams(-1.0, 3.0, QuantSpec.uint8_affine())
    assert qp.scale.item() == pytest.approx(4.0 / 255, rel=1e-7)
    assert qp.zero_point.item() == 64  # 0 - round(-1 / (4/255)) = round(63.75)


def test_range_is_extended_to_include_zero() -> None:
    qp = choose_qparams(2.0, 3.0, QuantSpec.uint8_affine())
    assert qp.zero_point.item() == 0
    assert qp.scale.item() == torch.tensor(3.0 / 255, dtype=torch.float32).item()


def test_symmetric_signed_and_unsigned() -> None:
    s = choose_qparams(-2.0, 1.0, QuantSpec.int8())
    assert s.scale.item() == torch.tensor(2.0 / 127.5).item() and s.zero_point.item() == 0
    n = choose_qparams(-2.0, 1.0, QuantSpec.int8(narrow_range=True))
    assert n.scale.item() == torch.tensor(2.0 / 127).item()
    u = choose_qparams(0.0, 4.0, QuantSpec(bits=8, signed=False, symmetric=True))
    assert u.zero_point.item() == 128
    u4 = choose_qparams(0.0, 4.0, QuantSpec(bits=4, signed=False, symmetric=True))
    assert u4.zero_point.item() == 8  # (0 + 15 + 1) // 2


def test_fp8_scale_is_amax_over_format_max() -> None:
    e4 = choose_qparams(-896.0, 10.0, QuantSpec.fp8_e4m3())
    assert e4.scale.item() == 2.0 and e4.zero_point.item() == 0
    e5 = choose_qparams(-1.0, 57344.0 * 4, QuantSpec.fp8_e5m2())
    assert e5.scale.item() == 4.0


@pytest.mark.parametrize("spec", [QuantSpec.int8(), QuantSpec.uint8_affine(), QuantSpec.fp8_e4m3()])
def test_power_of_two_scale_is_exact_ceiling(spec: QuantSpec) -> None:
    pow2 = spec.with_(scale_constraint=ScaleConstraint.POWER_OF_TWO)
    for amax in [0.3, 1.0, 127.5, 448.0, 1e-3, 5e3]:
        plain = choose_qparams(-amax, amax, spec).scale
        s = choose_qparams(-amax, amax, pow2).scale
        mantissa, _ = torch.frexp(s)
        assert mantissa.item() == 0.5  # a power of two
        assert plain.item() <= s.item() < 2 * plain.item()  # smallest power of two >= scale
    exact = choose_qparams(-127.5 * 0.25, 127.5 * 0.25, QuantSpec.int8(scale_constraint=ScaleConstraint.POWER_OF_TWO))
    assert exact.scale.item() == 0.25  # already a power of two: unchanged


def test_power_of_two_affine_zero_point_uses_rounded_scale() -> None:
    spec = QuantSpec.uint8_affine(scale_constraint=ScaleConstraint.POWER_OF_TWO)
    qp = choose_qparams(-1.0, 2.0, spec)
    assert qp.scale.item() == 2.0**-6  # 3/255 = 0.01176 -> 1/64
    assert qp.zero_point.item() == 64  # 0 - round(-1 * 64)


@pytest.mark.parametrize("spec", [QuantSpec.int8(), QuantSpec.uint8_affine(), QuantSpec.fp8_e5m2(),
                                  QuantSpec.int8(scale_constraint=ScaleConstraint.POWER_OF_TWO)])
def test_zero_range_gives_eps_scale(spec: QuantSpec) -> None:
    qp = choose_qparams(torch.zeros(3), torch.zeros(3), spec)
    assert torch.all(qp.scale == EPS)
    assert torch.isfinite(qp.scale).all() and (qp.scale > 0).all()


@pytest.mark.parametrize("amax", [1e-6, 1e-8, 1e-20, 1e-30])
def test_tiny_ranges_keep_every_level(amax: float) -> None:
    """The scale floor is relative: amax / 127 (smallest normal float32 at least), not torch.ao's eps, which
    would code |x| <= 5.9e-8 as 0."""
    x = torch.tensor([-amax, amax / 3, amax], dtype=torch.float32)
    qp = choose_qparams(x.min(), x.max(), QuantSpec.int8(narrow_range=True))
    assert qp.scale.item() == pytest.approx(amax / 127, rel=1e-6, abs=0)
    q = torch.clamp(torch.round(x / qp.scale), -127, 127)
    assert q.tolist() == [-127.0, 42.0, 127.0]
    assert (q * qp.scale - x).abs().max().item() <= qp.scale.item() / 2 * (1 + 1e-6)
    fp8 = choose_qparams(x.min(), x.max(), QuantSpec.fp8_e5m2())
    assert fp8.scale.item() == pytest.approx(amax / QuantSpec.fp8_e5m2().fp_max, rel=1e-6, abs=0)


def test_ranges_below_float32s_normal_range_get_the_smallest_normal_scale() -> None:
    for spec in (QuantSpec.int8(), QuantSpec.uint8_affine(), QuantSpec.int8(scale_constraint=ScaleConstraint.POWER_OF_TWO)):
        qp = choose_qparams(-1e-40, 1e-40, spec)  # denormal data
        assert qp.scale.item() == TINY  # 2**-126: a power of two already
        assert TINY == 2.0**-126


def test_nan_or_inf_range_raises_data_error() -> None:
    with pytest.raises(DataError, match="NaN or Inf"):
        choose_qparams(float("nan"), 1.0, QuantSpec.int8(), name="conv1.weight")
    with pytest.raises(DataError, match="conv1.out"):
        choose_qparams(torch.tensor([0.0, -1.0]), torch.tensor([float("inf"), 1.0]), QuantSpec.int8(),
                       name="conv1.out")


def test_never_observed_range_raises_calibration_error() -> None:
    with pytest.raises(CalibrationError, match="never observed.*relu_3"):
        choose_qparams(float("inf"), float("-inf"), QuantSpec.uint8_affine(), name="relu_3")
    with pytest.raises(CalibrationError, match="empty"):
        choose_qparams(torch.empty(0), torch.empty(0), QuantSpec.int8())


def test_shape_mismatch_raises() -> None:
    with pytest.raises(DataError, match="shape"):
        choose_qparams(torch.zeros(3), torch.ones(4), QuantSpec.int8())
    with pytest.raises(DataError, match="zero_point shape"):
        QParams(scale=torch.ones(3), zero_point=torch.zeros(2, dtype=torch.int32))


def test_per_group_shapes_pass_through() -> None:
    torch.manual_seed(0)
    lo = -torch.rand(4, 3)
    hi = torch.rand(4, 3)
    qp = choose_qparams(lo, hi, QuantSpec.int4_per_group(group_size=32, axis=1))
    assert qp.scale.shape == (4, 3) and qp.zero_point.shape == (4, 3)
    assert torch.equal(qp.scale, torch.maximum(-lo, hi) / 7.5)  # ranges far above the floor
