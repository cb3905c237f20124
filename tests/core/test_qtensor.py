"""QTensor against torch's own quantized tensors (the quantized-tensor tutorial's operations)."""

from __future__ import annotations

import copy
import io
import pickle
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from netquant import QTensor
from netquant.core import choose_qparams, quantize
from netquant.core.qparams import QParams
from netquant.core.qtensor import load_safetensors, save_safetensors, torch_adds_zero_point_first
from netquant.core.spec import Granularity, QuantSpec, RoundingPolicy
from netquant.errors import ConfigError, DataError

# torch 2.13 deprecates its quantized tensors; they are our reference here
pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated:UserWarning")

QDTYPES = [torch.quint8, torch.qint8, torch.qint32]
ZP_RANGE = {torch.quint8: (0, 255), torch.qint8: (-128, 127), torch.qint32: (-1000, 1000)}


def _rand_params(gen: torch.Generator, qdtype: torch.dtype, n: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    shape = () if n is None else (n,)
    scale = (torch.rand(shape, generator=gen) * 0.2 + 1e-3).float()  # float32-exact scales
    lo, hi = ZP_RANGE[qdtype]
    return scale, torch.randint(lo, hi + 1, shape, generator=gen)


def _torch_per_tensor_reference(x: torch.Tensor, scale: float, zp: int, qdtype: torch.dtype) -> torch.Tensor:
    """torch.quantize_per_tensor's CPU formula: q = clamp(round_half_even(fl(x * fl(1/s)) + z))."""
    inv = torch.reciprocal(torch.tensor(scale, dtype=torch.float32))
    lo, hi = (torch.iinfo(torch.int32).min, torch.iinfo(torch.int32).max) if qdtype is torch.qint32 else (
        (0, 255) if qdtype is torch.quint8 else (-128, 127))
    return torch.round(x * inv + zp).double().clamp(lo, hi)


def _expand_param(qt: QTensor, p: torch.Tensor) -> torch.Tensor:
    """A QTensor's per-element param value, shape qt.shape."""
    if qt.axis is None:
        return p.expand(qt.shape)
    return p.reshape([-1 if d == qt.axis else 1 for d in range(qt.ndim)]).expand(qt.shape)


# ---- creation ---------------------------------------------------------------------------
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_quantize_per_tensor_matches_torch(qdtype: torch.dtype, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    shape = tuple(int(d) for d in torch.randint(1, 9, (int(torch.randint(1, 4, (), generator=gen)),), generator=gen))
    x = torch.randn(shape, generator=gen) * 4
    scale, zp = _rand_params(gen, qdtype)
    ref = torch.quantize_per_tensor(x, float(scale), int(zp), qdtype)
    qt = QTensor.quantize_per_tensor(x, float(scale), int(zp), qdtype)
    assert qt.is_quantized and qt.dtype == ref.int_repr().dtype and qt.shape == ref.shape
    assert qt.q_scale() == ref.q_scale() and qt.q_zero_point() == ref.q_zero_point()
    ours, theirs = qt.int_repr(), ref.int_repr()
    if qdtype is not torch.qint32:  # 8-bit: torch's own rounding order, bit for bit
        assert torch.equal(ours, theirs)
        assert torch.equal(qt.dequantize(), ref.dequantize())
        return
    # qint32 keeps netquant's exact integer path: torch rounds the float32 sum x*(1/s) + z (pinned down
    # here), netquant rounds x*(1/s) and adds z exactly. Any difference is such a double rounding.
    assert torch.equal(_torch_per_tensor_reference(x, float(scale), int(zp), qdtype), theirs.double())
    differ = ours != theirs
    exact = (torch.round(x * torch.reciprocal(scale)) + zp).double().clamp(*qt.qrange)
    assert torch.equal(ours.double()[differ], exact[differ])
    assert int(differ.sum()) <= max(1, x.numel() // 1000)
    assert torch.equal(qt.dequantize()[~differ], ref.dequantize()[~differ])


def _tie_heavy(gen: torch.Generator, scale: torch.Tensor, n: int) -> torch.Tensor:
    """Values on exact ties x/s = k + 0.5, their float32 neighbours, and ordinary values."""
    k = torch.randint(-300, 300, scale.shape + (n,), generator=gen).float() + 0.5
    ties = k * scale.unsqueeze(-1)
    return torch.cat([ties, ties.nextafter(torch.tensor(1e9)), ties.nextafter(torch.tensor(-1e9)),
                      torch.randn(scale.shape + (n,), generator=gen) * 3], dim=-1)


@pytest.mark.parametrize("qdtype", [torch.quint8, torch.qint8])
def test_torch_signature_constructors_reproduce_torch_on_ties(qdtype: torch.dtype) -> None:
    """quantize_per_tensor / quantize_per_channel round x/s + z exactly as torch does, ties included."""
    gen = torch.Generator().manual_seed(11)
    for _ in range(20):
        scale, zp = _rand_params(gen, qdtype)
        x = _tie_heavy(gen, scale, 1024)
        ref = torch.quantize_per_tensor(x, float(scale), int(zp), qdtype).int_repr()
        assert torch.equal(QTensor.quantize_per_tensor(x, float(scale), int(zp), qdtype).int_repr(), ref)
        scales, zps = _rand_params(gen, qdtype, 3)
        xc = _tie_heavy(gen, scales, 512)
        refc = torch.quantize_per_channel(xc, scales.double(), zps, 0, qdtype).int_repr()
        assert torch.equal(QTensor.quantize_per_channel(xc, scales, zps, 0, qdtype).int_repr(), refc)


def test_netquant_quantize_keeps_onnx_order_where_torch_differs() -> None:
    # float32 neighbours of a tie x/s = -2.5 with z = 78: torch rounds fl(x*(1/s) + 78), netquant's
    # quantize (and QTensor.quantize) round x*(1/s) first, then add z: ONNX QuantizeLinear's order.
    scale, zp = 0.1, 78
    x = torch.tensor(-0.25)
    below, above = [x], [x]
    for _ in range(64):
        below.append(torch.nextafter(below[-1], torch.tensor(-1.0)))
        above.append(torch.nextafter(above[-1], torch.tensor(1.0)))
    x = torch.stack(below[::-1] + above[1:])
    ref = torch.quantize_per_tensor(x, scale, zp, torch.quint8).int_repr()
    assert torch.equal(QTensor.quantize_per_tensor(x, scale, zp, torch.quint8).int_repr(), ref)
    spec = QuantSpec(bits=8, signed=False, symmetric=False)
    onnx_order = QTensor.quantize(x, spec, QParams(torch.tensor(scale), torch.tensor(zp, dtype=torch.int32)))
    t = x * torch.reciprocal(torch.tensor(scale))
    assert torch.equal(onnx_order.int_repr().double(), torch.round(t).double() + zp)
    differ = onnx_order.int_repr() != ref
    if not torch_adds_zero_point_first(False):  # this torch build rounds first too: nothing differs
        assert not bool(differ.any())
        return
    assert 0 < int(differ.sum()) < x.numel()
    total = t + zp  # only where the float32 sum lands on a tie although x*(1/s) is not one
    assert bool((differ <= (((total - total.floor()) == 0.5) & ((t - t.floor()) != 0.5))).all())


def test_quantize_per_tensor_zero_zero_point_bit_exact() -> None:
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(4096, generator=gen) * 10
    for qdtype in (torch.qint8, torch.qint32):
        ref = torch.quantize_per_tensor(x, 0.0473, 0, qdtype)
        qt = QTensor.quantize_per_tensor(x, 0.0473, 0, qdtype)
        assert torch.equal(qt.int_repr(), ref.int_repr())
        assert torch.equal(qt.dequantize(), ref.dequantize())


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_quantize_per_channel_matches_torch(qdtype: torch.dtype, axis: int) -> None:
    gen = torch.Generator().manual_seed(11 + axis)
    x = torch.randn(5, 6, 7, generator=gen) * 3
    n = x.shape[axis]
    scales, zps = _rand_params(gen, qdtype, n)
    ref = torch.quantize_per_channel(x, scales, zps, axis % 3, qdtype)
    qt = QTensor.quantize_per_channel(x, scales, zps, axis, qdtype)
    assert torch.equal(qt.int_repr(), ref.int_repr())
    assert torch.equal(qt.dequantize(), ref.dequantize())
    assert qt.q_per_channel_axis() == ref.q_per_channel_axis() == axis % 3
    assert torch.equal(qt.q_per_channel_scales().double(), ref.q_per_channel_scales())
    assert torch.equal(qt.q_per_channel_zero_points(), ref.q_per_channel_zero_points())
    assert qt.qscheme() == ref.qscheme()


@pytest.mark.parametrize("spec", [
    QuantSpec.int8(), QuantSpec.uint8_affine(), QuantSpec(bits=4, signed=True, symmetric=False),
    QuantSpec(bits=12, signed=False, symmetric=False), QuantSpec.int8_per_channel(axis=1),
    QuantSpec.int8(narrow_range=True), QuantSpec.fp8_e4m3(), QuantSpec.fp8_e5m2(),
], ids=lambda s: s.describe())
def test_quantize_with_spec_chooses_params_from_data(spec: QuantSpec) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, generator=gen) * 2 + 0.5
    qt = QTensor.quantize(x, spec)
    if spec.granularity is Granularity.PER_CHANNEL:
        params = choose_qparams(x.amin(dim=0), x.amax(dim=0), spec)
    else:
        params = choose_qparams(x.min(), x.max(), spec)
    assert torch.equal(qt.scale, params.scale) and torch.equal(qt.zero_point, params.zero_point.to(torch.int32))
    assert qt.dtype == spec.storage_dtype
    expected = quantize(x, params.scale, params.zero_point, spec)
    assert torch.equal(qt.int_repr().view(torch.uint8) if spec.is_float else qt.int_repr(),
                       expected.view(torch.uint8) if spec.is_float else expected)
    if not spec.is_float:  # the observed range is representable: error <= s/2
        err = (qt.dequantize() - x).abs()
        assert bool((err <= _expand_param(qt, qt.scale) / 2 + 1e-6).all())


def test_fp8_qtensor_equals_cast_after_scaling() -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, 16, generator=gen) * 100
    for spec, dtype in ((QuantSpec.fp8_e4m3(), torch.float8_e4m3fn), (QuantSpec.fp8_e5m2(), torch.float8_e5m2)):
        qt = QTensor.quantize(x, spec)
        s = qt.scale
        assert qt.int_repr().dtype == dtype and qt.is_float
        assert torch.equal(qt.dequantize(), (x / s).clamp(-spec.fp_max, spec.fp_max).to(dtype).float() * s)
        # FP8 QTensors index, assign, transpose and save like integer ones
        qt[0, 0] = 1.0
        assert qt[0, 0].item() == ((torch.tensor(1.0) / s).to(dtype).float() * s).item()
        assert torch.equal(qt.transpose(0, 1).dequantize(), qt.dequantize().t())
        assert _torch_roundtrip(qt).equal(qt)


def test_from_int_matches_torch_make_quantized_tensor() -> None:
    ints = torch.tensor([[0, 10, 255], [128, 3, 77]], dtype=torch.uint8)
    ref = torch._make_per_tensor_quantized_tensor(ints, 0.25, 10)
    qt = QTensor.from_int(ints, 0.25, 10)
    assert torch.equal(qt.int_repr(), ints) and torch.equal(qt.dequantize(), ref.dequantize())
    assert qt.spec == QuantSpec.uint8_affine()
    scales, zps = torch.tensor([0.5, 0.125]), torch.tensor([3, -4])
    ints8 = torch.tensor([[-128, 0, 127], [5, -5, 9]], dtype=torch.int8)
    ref = torch._make_per_channel_quantized_tensor(ints8, scales.double(), zps, 0)
    qt = QTensor.from_int(ints8, scales, zps, axis=0)
    assert torch.equal(qt.dequantize(), ref.dequantize()) and qt.axis == 0
    # int32 data, and a wider integer dtype cast down to a 4-bit spec's storage
    i32 = torch.tensor([-70000, 0, 123456], dtype=torch.int32)
    assert torch.equal(QTensor.from_int(i32, 0.5, 0).dequantize(),
                       torch._make_per_tensor_quantized_tensor(i32, 0.5, 0).dequantize())
    qt4 = QTensor.from_int(torch.tensor([-8, 7, 0]), 0.5, 0, QuantSpec(bits=4))
    assert qt4.dtype == torch.int8 and qt4.dequantize().tolist() == [-4.0, 3.5, 0.0]


@pytest.mark.parametrize("make, err, words", [
    (lambda: QTensor.from_int(torch.tensor([0, 8]), 1.0, 0, QuantSpec(bits=4)), DataError, "outside the range"),
    (lambda: QTensor.from_int(torch.tensor([0.5]), 1.0, 0, QuantSpec.int8()), DataError, "QTensor.quantize"),
    (lambda: QTensor.from_int(torch.tensor([1], dtype=torch.int16), 1.0, 0), ConfigError, "give a spec"),
    (lambda: QTensor.from_int(torch.tensor([1], dtype=torch.uint8), 0.0, 0), DataError, "finite and > 0"),
    (lambda: QTensor.from_int(torch.tensor([1], dtype=torch.uint8), float("nan"), 0), DataError, "finite"),
    (lambda: QTensor.from_int(torch.tensor([1], dtype=torch.uint8), float("inf"), 0), DataError, "finite"),
    (lambda: QTensor.from_int(torch.tensor([1], dtype=torch.uint8), -1.0, 0), DataError, "> 0"),
    (lambda: QTensor.from_int(torch.tensor([1], dtype=torch.uint8), 1.0, 300), DataError, "zero_point"),
    (lambda: QTensor.from_int(torch.zeros(2, 3, dtype=torch.int8), torch.ones(3), torch.zeros(3), axis=0),
     DataError, "per-channel along axis 0"),
    (lambda: QTensor.from_int(torch.zeros(2, dtype=torch.int8), 1.0, 0, axis=3), ConfigError, "out of range"),
    (lambda: QTensor(torch.zeros(4, dtype=torch.int8), 1.0, 0, QuantSpec.int4_per_group(group_size=2, axis=0)),
     ConfigError, "per-group"),
    (lambda: QTensor(torch.zeros(4, dtype=torch.int8), 1.0, 0, "int8"), ConfigError, "QuantSpec"),
    (lambda: QTensor(torch.zeros(2, dtype=torch.float8_e4m3fn), 1.0, 3, QuantSpec.fp8_e4m3()), DataError, "zero"),
    (lambda: QTensor.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.float32), ConfigError, "quint8"),
    (lambda: QTensor.from_int(torch.tensor([1], dtype=torch.uint8), 1.0, 2**32), DataError, "zero_point"),
    (lambda: QTensor.from_int(torch.tensor([1], dtype=torch.uint8), 1.0, 0.5), DataError, "integers"),
    (lambda: QTensor.quantize(torch.ones(2, 3), QuantSpec.int8_per_channel(axis=2)), ConfigError, "out of range"),
    (lambda: QTensor.quantize(torch.tensor(1.0), QuantSpec.int8_per_channel(axis=0)), ConfigError, "out of range"),
    (lambda: QTensor.quantize_per_channel(torch.tensor(1.0), torch.ones(1), torch.zeros(1), 0), DataError, "0-d"),
])
def test_bad_construction_raises_clear_errors(make, err, words) -> None:
    with pytest.raises(err, match=words):
        make()


# ---- accessors --------------------------------------------------------------------------
def test_accessors_match_torch() -> None:
    x = torch.linspace(-3, 3, 24).reshape(2, 3, 4)
    ref = torch.quantize_per_tensor(x, 0.05, 7, torch.qint8)
    qt = QTensor.quantize_per_tensor(x, 0.05, 7, torch.qint8)
    assert qt.numel() == ref.numel() and qt.size() == ref.size() and qt.size(1) == ref.size(1) == 3
    assert qt.shape == ref.shape and qt.dim() == ref.dim() == qt.ndim and len(qt) == len(ref)
    assert qt[1, 2, 3].item() == ref[1, 2, 3].item()
    assert qt.is_quantized is True and qt.params.scale.item() == pytest.approx(0.05)
    with pytest.raises(DataError, match="one element"):
        qt.item()
    with pytest.raises(ConfigError, match="q_scale"):
        qt.q_per_channel_scales()
    pc = QTensor.quantize(x, QuantSpec.int8_per_channel(axis=2))
    with pytest.raises(ConfigError, match="per-channel"):
        pc.q_scale()
    with pytest.raises(ConfigError, match="per-channel"):
        pc.q_zero_point()
    assert pc.is_per_channel and not qt.is_per_channel


def test_repr_is_readable() -> None:
    qt = QTensor.quantize_per_tensor(torch.tensor([-1.0, 0.0, 1.0, 2.0]), 0.1, 10, torch.quint8)
    text = repr(qt)
    assert text.startswith("QTensor([-1.,  0.,  1.,  2.]") and "dtype=uint8" in text
    assert "scale=0.1" in text and "zero_point=10" in text and "size=(4,)" in text
    pc = QTensor.quantize_per_channel(torch.tensor([[-1.0, 0.0], [1.0, 2.0]]), torch.tensor([0.1, 0.01]),
                                      torch.tensor([10, 0]), 0, torch.quint8)
    text = repr(pc)
    assert "axis=0" in text and "per_channel" in text and "zero_point=[10, 0]" in text and "scale=[0.1, 0.01]" in text


# ---- indexing ---------------------------------------------------------------------------
PER_TENSOR_INDICES = [1, -1, (0, 2), (slice(None), 1), (slice(1, None), slice(None, None, 2)), (..., 0),
                      (None, 0), [0, 1], (torch.tensor([1, 0]), slice(None))]


@pytest.mark.parametrize("index", PER_TENSOR_INDICES, ids=repr)
def test_per_tensor_indexing_matches_torch(index) -> None:
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    ref = torch.quantize_per_tensor(x, 0.02, 128, torch.quint8)
    qt = QTensor.from_torch(ref)
    sub, ref_sub = qt[index], ref[index]
    assert torch.equal(sub.int_repr(), ref_sub.int_repr())
    assert torch.equal(sub.dequantize(), ref_sub.dequantize())
    assert sub.q_scale() == pytest.approx(ref_sub.q_scale()) and sub.q_zero_point() == ref_sub.q_zero_point()


PER_CHANNEL_INDICES = [0, 2, -1, (slice(None), 1), (slice(None), slice(1, 3)), (slice(None), -1, slice(0, 2)),
                       (..., 1), (..., slice(None, None, 2)), (None, slice(None), 0), (0, None, slice(1, None)),
                       (slice(None), [2, 0]), (slice(None), torch.tensor([True, False, True, False])),
                       ([1, 0], slice(None), 2), (slice(None), slice(0, 1)), (slice(None), torch.tensor(1)),
                       (slice(None), []), (True, slice(None), 1), (0, False)]


@pytest.mark.parametrize("index", PER_CHANNEL_INDICES, ids=repr)
def test_per_channel_params_follow_the_slice(index) -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 5, generator=gen)
    scales, zps = _rand_params(gen, torch.qint8, 4)
    qt = QTensor.quantize_per_channel(x, scales, zps, 1, torch.qint8)
    sub = qt[index]
    assert torch.equal(sub.int_repr(), qt.int_repr()[index])
    assert torch.equal(sub.dequantize(), qt.dequantize()[index])
    # every element keeps its own channel's params
    assert torch.equal(_expand_param(sub, sub.scale), _expand_param(qt, qt.scale)[index])
    assert torch.equal(_expand_param(sub, sub.zero_point), _expand_param(qt, qt.zero_point)[index])
    # and the slice equals quantizing the sliced floats with those params (torch as reference)
    if sub.axis is not None:
        ref = torch.quantize_per_channel(x[index], sub.scale, sub.zero_point, sub.axis, torch.qint8)
    else:
        ref = torch.quantize_per_tensor(x[index], float(sub.scale), int(sub.zero_point), torch.qint8)
    assert torch.equal(sub.int_repr(), ref.int_repr())


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_random_basic_indices_keep_each_elements_params(data) -> None:
    shape = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4), label="shape")
    axis = data.draw(st.integers(-len(shape), len(shape) - 1), label="axis")
    items: list = []
    n_items = data.draw(st.integers(0, len(shape)), label="n_items")
    for size in shape[:n_items]:  # one int or slice per leading dim, maybe after a new axis
        if data.draw(st.booleans(), label="new axis"):
            items.append(None)
        if data.draw(st.booleans(), label="int"):
            items.append(data.draw(st.integers(-size, size - 1)))
        else:
            items.append(slice(data.draw(st.integers(-size, size)), data.draw(st.integers(-size, size)),
                               data.draw(st.integers(1, 3))))
    if data.draw(st.booleans(), label="ellipsis"):  # anywhere if it stands for no dims, else at the end
        items.insert(data.draw(st.integers(0, len(items))) if n_items == len(shape) else len(items), Ellipsis)
    index = tuple(items)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
    n = shape[axis]
    qt = QTensor.quantize_per_channel(x, torch.arange(1, n + 1) * 0.01, torch.arange(n) - 1, axis, torch.qint8)
    sub = qt[index]
    assert torch.equal(sub.int_repr(), qt.int_repr()[index])
    assert torch.equal(_expand_param(sub, sub.scale), _expand_param(qt, qt.scale)[index])
    assert torch.equal(_expand_param(sub, sub.zero_point), _expand_param(qt, qt.zero_point)[index])
    assert torch.equal(sub.dequantize(), qt.dequantize()[index])


def test_reshape_and_iteration() -> None:
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(4, 5, generator=gen)
    ref = torch.quantize_per_tensor(x, 0.02, 3, torch.qint8)
    qt = QTensor.from_torch(ref)
    assert torch.equal(qt.reshape(2, 10).int_repr(), ref.reshape(2, 10).int_repr())
    assert torch.equal(qt.reshape([-1]).dequantize(), ref.reshape(-1).dequantize())
    assert [row.int_repr().tolist() for row in qt] == ref.int_repr().tolist()
    scales, zps = _rand_params(gen, torch.qint8, 4)
    pc = QTensor.quantize_per_channel(x, scales, zps, 0, torch.qint8)
    for shape in ((4, 1, 5), (20,), (1, 4, 5, 1)):
        moved = pc.reshape(shape)
        assert torch.equal(moved.int_repr(), pc.int_repr().reshape(shape))
        assert torch.equal(_expand_param(moved, moved.scale), _expand_param(pc, pc.scale).reshape(shape))
        assert torch.equal(moved.dequantize(), pc.dequantize().reshape(shape))
    assert pc.reshape(1, 4, 5, 1).axis == 1
    with pytest.raises(DataError, match="reshaping .* mixes channels"):
        pc.reshape(2, 10)


def test_per_channel_int_index_on_axis_matches_torch() -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(4))
    ref = torch.quantize_per_channel(x, torch.tensor([0.1, 0.2, 0.3]), torch.tensor([1, 2, 3]), 0, torch.quint8)
    qt = QTensor.from_torch(ref)
    for i in range(3):  # torch turns q[i] into a per-tensor tensor with channel i's params
        assert ref[i].qscheme() == qt[i].qscheme() == torch.per_tensor_affine
        assert qt[i].q_scale() == pytest.approx(ref[i].q_scale()) and qt[i].q_zero_point() == ref[i].q_zero_point()
        assert torch.equal(qt[i].int_repr(), ref[i].int_repr()) and torch.equal(qt[i].dequantize(), ref[i].dequantize())
    assert qt[1:3].q_per_channel_scales().tolist() == pytest.approx([0.2, 0.3])
    assert qt[1:3].q_per_channel_zero_points().tolist() == [2, 3]


def test_indexing_that_mixes_channels_is_refused() -> None:
    qt = QTensor.quantize(torch.randn(2, 3), QuantSpec.int8_per_channel(axis=0))
    with pytest.raises(DataError, match="mixes channels"):
        qt[torch.tensor([[0, 1], [1, 0]])]


# ---- assignment and copy ------------------------------------------------------------------
def test_assigning_floats_quantizes_them_like_torch() -> None:
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(6))
    ref = torch.quantize_per_tensor(x, 0.1, 10, torch.quint8)
    qt = QTensor.from_torch(ref)
    for index, value in (((0, 1), 3.5), (1, 2.25), ((slice(1, 3), slice(None)), -0.7)):
        ref[index] = value
        qt[index] = value
        assert torch.equal(qt.int_repr(), ref.int_repr()), index
    qt[:, 3] = -0.7  # torch refuses ("Quantized copy only works with contiguous ... Tensors")
    assert qt[:, 3].int_repr().tolist() == [3, 3, 3]  # round(-0.7 / 0.1) + 10
    qt[2] = torch.tensor([1.0, 2.0, 100.0, -100.0])  # saturates
    assert qt[2].int_repr().tolist() == [20, 30, 255, 0]
    qt[0, 0] = QTensor.quantize_per_tensor(torch.tensor(0.5), 0.25, 0, torch.qint8)  # a QTensor value
    assert qt[0, 0].item() == pytest.approx(0.5)


def test_assigning_into_per_channel_uses_each_elements_params() -> None:
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(3, 4, generator=gen)
    scales, zps = _rand_params(gen, torch.quint8, 4)
    qt = QTensor.quantize_per_channel(x, scales, zps, 1, torch.quint8)
    new = torch.randn(4, generator=gen)
    qt[1] = new
    x[1] = new
    qt[:, 2] = 0.3
    x[:, 2] = 0.3
    qt[[0, 2], 0] = torch.tensor([1.5, -1.5])
    x[[0, 2], 0] = torch.tensor([1.5, -1.5])
    ref = torch.quantize_per_channel(x, scales, zps, 1, torch.quint8)
    assert torch.equal(qt.int_repr(), ref.int_repr())


def test_assignment_errors() -> None:
    qt = QTensor.quantize_per_tensor(torch.zeros(2, 3), 0.1, 0, torch.qint8)
    with pytest.raises(DataError, match="NaN"):
        qt[0, 0] = float("nan")
    with pytest.raises(DataError, match="shape"):
        qt[0] = torch.ones(4)
    assert torch.equal(qt.int_repr(), torch.zeros(2, 3, dtype=torch.int8))  # unchanged


def test_copy_requantizes_into_the_destination_params() -> None:
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 5, generator=gen)
    dst = QTensor.quantize_per_tensor(torch.zeros(4, 5), 0.1, 10, torch.quint8)
    src = QTensor.quantize_per_tensor(x * 2, 0.05, 3, torch.qint8)
    assert dst.copy_(src) is dst
    # torch's copy_ would take over src's params; ours keeps dst's and requantizes src's values
    ref = torch.quantize_per_tensor(src.dequantize(), 0.1, 10, torch.quint8)
    assert torch.equal(dst.int_repr(), ref.int_repr()) and dst.q_scale() == pytest.approx(0.1)
    scales, zps = _rand_params(gen, torch.quint8, 5)
    pc = QTensor.quantize_per_channel(torch.zeros(4, 5), scales, zps, 1, torch.quint8)
    pc.copy_(src)
    ref = torch.quantize_per_channel(src.dequantize(), scales, zps, 1, torch.quint8)
    assert torch.equal(pc.int_repr(), ref.int_repr())
    pc.copy_(torch.linspace(-1, 1, 5))  # a float tensor broadcasts
    ref = torch.quantize_per_channel(torch.linspace(-1, 1, 5).expand(4, 5), scales, zps, 1, torch.quint8)
    assert torch.equal(pc.int_repr(), ref.int_repr())
    with pytest.raises(DataError, match="broadcast"):
        pc.copy_(torch.ones(3))


# ---- layout -----------------------------------------------------------------------------
def test_transpose_permute_contiguous() -> None:
    gen = torch.Generator().manual_seed(10)
    x = torch.randn(2, 3, 4, generator=gen)
    ref = torch.quantize_per_tensor(x, 0.03, 5, torch.quint8)
    qt = QTensor.from_torch(ref)
    assert torch.equal(qt.transpose(0, 2).int_repr(), ref.transpose(0, 2).int_repr())
    assert torch.equal(qt.permute(2, 0, 1).dequantize(), ref.permute(2, 0, 1).dequantize())
    t = qt.transpose(1, 2)
    assert not t.int_repr().is_contiguous() and t.contiguous().int_repr().is_contiguous()
    assert torch.equal(t.contiguous().int_repr(), ref.transpose(1, 2).contiguous().int_repr())
    scales, zps = _rand_params(gen, torch.qint8, 3)
    pc = QTensor.quantize_per_channel(x, scales, zps, 1, torch.qint8)
    # torch cannot transpose per-channel tensors ("Setting strides is possible only on uniformly quantized
    # tensor"); the reference is quantizing the permuted floats per channel along the moved axis
    for moved, perm, axis in ((pc.transpose(0, 1), (1, 0, 2), 0), (pc.transpose(1, -1), (0, 2, 1), 2),
                              (pc.transpose(0, 2), (2, 1, 0), 1), (pc.permute(1, 2, 0), (1, 2, 0), 0),
                              (pc.permute([2, 0, 1]), (2, 0, 1), 2), (pc.permute(-1, -2, -3), (2, 1, 0), 1)):
        assert moved.axis == axis and moved.q_per_channel_axis() == axis and moved.spec.axis == axis
        ref = torch.quantize_per_channel(x.permute(*perm), scales, zps, axis, torch.qint8)
        assert torch.equal(moved.int_repr(), ref.int_repr())
        assert torch.equal(moved.contiguous().dequantize(), ref.dequantize())
        assert moved.contiguous().int_repr().is_contiguous()


# ---- save / load -----------------------------------------------------------------------------
def _torch_roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def test_torch_save_load_weights_only() -> None:
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(3, 4, generator=gen)
    pt = QTensor.quantize_per_tensor(x, 0.02, -3, torch.qint8)
    pc = QTensor.quantize(x, QuantSpec.int8_per_channel(axis=1, rounding=RoundingPolicy.ROUND_HALF_UP))
    i4 = QTensor.quantize(x, QuantSpec(bits=4, signed=False, symmetric=False))
    f8 = QTensor.quantize(x, QuantSpec.fp8_e5m2())
    i32 = QTensor.quantize_per_tensor(x, 0.001, 0, torch.qint32)
    loaded = _torch_roundtrip({"pt": pt, "pc": pc, "i4": i4, "f8": f8, "i32": i32, "plain": x})
    for name, qt in (("pt", pt), ("pc", pc), ("i4", i4), ("f8", f8), ("i32", i32)):
        assert isinstance(loaded[name], QTensor) and loaded[name].equal(qt), name
        assert loaded[name].spec == qt.spec
    assert torch.equal(loaded["plain"], x)
    assert _torch_roundtrip(pc).equal(pc)
    # a slice saves only its own elements, with its own params
    big = QTensor.quantize(torch.randn(256, 256, generator=gen), QuantSpec.int8_per_channel(axis=0))
    row = big[3]
    buf_row, buf_big = io.BytesIO(), io.BytesIO()
    torch.save(row, buf_row)
    torch.save(big, buf_big)
    assert len(buf_row.getvalue()) * 10 < len(buf_big.getvalue())
    assert _torch_roundtrip(row).equal(row)
    assert pickle.loads(pickle.dumps(pc)).equal(pc) and copy.deepcopy(pc).equal(pc)


def test_torch_load_rejects_tampered_payload() -> None:
    qt = QTensor.quantize_per_tensor(torch.ones(3), 0.1, 0, torch.qint8)
    bad = QTensor.__new__(QTensor)  # ints outside a 4-bit range: the rebuild validates them
    bad._spec, bad._axis = QuantSpec(bits=4), None
    bad._data, bad._scale, bad._zero_point = torch.tensor([100], dtype=torch.int8), qt.scale, qt.zero_point
    with pytest.raises(DataError, match="outside the range"):
        _torch_roundtrip(bad)


def test_safetensors_roundtrip(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(6, 5, generator=gen)
    tensors = {
        "w": QTensor.quantize(x, QuantSpec.int8_per_channel(axis=0)),
        "a": QTensor.quantize_per_tensor(x, 0.03, 128, torch.quint8),
        "f": QTensor.quantize(x, QuantSpec.fp8_e4m3()),
        "b": QTensor.quantize_per_tensor(x[0], 0.0001, 0, torch.qint32),
        "w_row": QTensor.quantize(x, QuantSpec.int8_per_channel(axis=1))[2],
        "bias": x[:, 0],
    }
    path = tmp_path / "model.safetensors"
    save_safetensors(tensors, path, metadata={"format": "pt"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors"]  # no temp file left
    loaded = load_safetensors(path)
    assert loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        if isinstance(value, QTensor):
            assert loaded[name].equal(value), name
        else:
            assert torch.equal(loaded[name], value)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:  # stored as plain tensors a reader can use
        assert f.get_tensor("w.qdata").dtype == torch.int8 and f.metadata()["format"] == "pt"


def test_safetensors_errors(tmp_path: Path) -> None:
    qt = QTensor.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)
    with pytest.raises(DataError, match="used twice"):
        save_safetensors({"w": qt, "w.scale": torch.ones(1)}, tmp_path / "x.safetensors")
    with pytest.raises(DataError, match="not a QTensor"):
        save_safetensors({"w": [1, 2]}, tmp_path / "x.safetensors")
    assert list(tmp_path.iterdir()) == []  # nothing written
    with pytest.raises(DataError, match="missing.safetensors"):
        load_safetensors(tmp_path / "missing.safetensors")
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01 not a safetensors file")
    with pytest.raises(DataError, match="garbage.safetensors"):
        load_safetensors(garbage)
    from safetensors.torch import save_file

    broken = tmp_path / "broken.safetensors"
    save_file({"w.qdata": torch.zeros(2, dtype=torch.int8)}, str(broken),
              metadata={"netquant.qtensor:w": '{"spec": {"bits": 8}, "axis": null}'})
    with pytest.raises(DataError, match="'w' is malformed"):
        load_safetensors(broken)
    save_file({"w.qdata": torch.zeros(2, dtype=torch.int8), "w.scale": torch.tensor(0.1),
               "w.zero_point": torch.tensor(0, dtype=torch.int32)}, str(broken),
              metadata={"netquant.qtensor:w": '{"spec": {"bits": 8, "rounding": "sideways"}, "axis": null}'})
    with pytest.raises(DataError, match="spec .* is malformed"):
        load_safetensors(broken)


# ---- torch conversion ------------------------------------------------------------------------
@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("per_channel", [False, True])
def test_torch_conversion_roundtrip(qdtype: torch.dtype, per_channel: bool) -> None:
    gen = torch.Generator().manual_seed(14)
    x = torch.randn(4, 3, generator=gen) * 2
    if per_channel:
        scales, zps = _rand_params(gen, qdtype, 3)
        ref = torch.quantize_per_channel(x, scales, zps, 1, qdtype)
    else:
        scale, zp = _rand_params(gen, qdtype)
        ref = torch.quantize_per_tensor(x, float(scale), int(zp), qdtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # our conversions keep torch's deprecation warnings quiet
        qt = QTensor.from_torch(ref)
        back = qt.to_torch()
    assert torch.equal(qt.int_repr(), ref.int_repr()) and torch.equal(qt.dequantize(), ref.dequantize())
    assert back.dtype == ref.dtype and back.qscheme() == ref.qscheme()
    assert torch.equal(back.int_repr(), ref.int_repr()) and torch.equal(back.dequantize(), ref.dequantize())
    assert qt.spec.storage_dtype == ref.int_repr().dtype


def test_to_torch_copies_and_keeps_layout() -> None:
    qt = QTensor.quantize_per_tensor(torch.randn(3, 4, generator=torch.Generator().manual_seed(16)), 0.05, 2,
                                     torch.qint8)
    t = qt.transpose(0, 1).to_torch()
    assert torch.equal(t.int_repr(), qt.int_repr().t()) and torch.equal(t.dequantize(), qt.dequantize().t())
    pc = QTensor.quantize(torch.randn(3, 4), QuantSpec.int8_per_channel(axis=0))
    t = pc.transpose(0, 1).to_torch()  # axis 1 after the transpose
    assert t.q_per_channel_axis() == 1 and torch.equal(t.dequantize(), pc.dequantize().t())
    before = pc.int_repr()
    t[0, 0] = -float(pc.scale[0]) * 100  # the torch tensor owns its storage
    assert t.int_repr()[0, 0] == -100 and torch.equal(pc.int_repr(), before)


def test_torch_conversion_errors() -> None:
    with pytest.raises(DataError, match="quantized tensor"):
        QTensor.from_torch(torch.ones(3))
    fq = torch.quantize_per_channel(torch.randn(2, 3), torch.tensor([0.1, 0.2]), torch.tensor([0.5, 1.0]), 0,
                                    torch.quint8)
    with pytest.raises(ConfigError, match="float zero points"):
        QTensor.from_torch(fq)
    with pytest.raises(ConfigError, match="no quantized dtype"):
        QTensor.quantize(torch.randn(4), QuantSpec(bits=16)).to_torch()
    with pytest.raises(ConfigError, match="no quantized dtype"):
        QTensor.quantize(torch.randn(4), QuantSpec.fp8_e4m3()).to_torch()
    with pytest.raises(DataError, match="from_torch"):
        QTensor.quantize(torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8), QuantSpec.int8())


# ---- zero range, NaN, Inf ---------------------------------------------------------------------
def test_zero_range_tensor_gets_a_positive_scale_and_round_trips() -> None:
    for spec in (QuantSpec.int8(), QuantSpec.uint8_affine(), QuantSpec.fp8_e4m3()):
        qt = QTensor.quantize(torch.zeros(5), spec)
        assert float(qt.scale) == torch.finfo(torch.float32).eps
        assert torch.equal(qt.dequantize(), torch.zeros(5))
    x = torch.stack([torch.zeros(4), torch.linspace(-1, 1, 4), torch.full((4,), 0.0)])
    pc = QTensor.quantize(x, QuantSpec.int8_per_channel(axis=0))
    assert bool((pc.scale > 0).all()) and torch.equal(pc.dequantize()[[0, 2]], torch.zeros(2, 4))
    empty = QTensor.quantize(torch.zeros(0, 3), QuantSpec.int8())
    assert empty.numel() == 0 and empty.dequantize().shape == (0, 3)


def test_nan_is_refused_and_inf_saturates_like_torch() -> None:
    with pytest.raises(DataError, match="NaN"):
        QTensor.quantize_per_tensor(torch.tensor([1.0, float("nan")]), 0.1, 0, torch.qint8)
    with pytest.raises(DataError, match="NaN"):
        QTensor.quantize(torch.tensor([1.0, float("nan")]), QuantSpec.int8(), choose_qparams(-1.0, 1.0,
                                                                                          QuantSpec.int8()))
    with pytest.raises(DataError):  # data-chosen params from an Inf range: choose_qparams refuses
        QTensor.quantize(torch.tensor([1.0, float("inf")]), QuantSpec.int8())
    x = torch.tensor([float("inf"), -float("inf"), 1e30, -1e30, 0.5])
    for qdtype in (torch.quint8, torch.qint8):
        ref = torch.quantize_per_tensor(x, 0.1, 3, qdtype)
        assert torch.equal(QTensor.quantize_per_tensor(x, 0.1, 3, qdtype).int_repr(), ref.int_repr())
        ref = torch.quantize_per_channel(x[None], torch.tensor([0.1]), torch.tensor([3]), 0, qdtype)
        pc = QTensor.quantize_per_channel(x[None], torch.tensor([0.1]), torch.tensor([3]), 0, qdtype)
        assert torch.equal(pc.int_repr(), ref.int_repr())
    f8 = QTensor.quantize(x, QuantSpec.fp8_e4m3(), choose_qparams(-1.0, 1.0, QuantSpec.fp8_e4m3()))
    assert torch.equal(f8.dequantize()[:4], torch.tensor([448.0, -448.0, 448.0, -448.0]) * f8.scale)


def test_int32_saturates_like_torch() -> None:
    x = torch.tensor([float("inf"), -float("inf"), 1e10, -1e10, 3.0])
    ref = torch.quantize_per_tensor(x, 1.0, 0, torch.qint32)
    assert torch.equal(QTensor.quantize_per_tensor(x, 1.0, 0, torch.qint32).int_repr(), ref.int_repr())
