"""QTensor: a quantized tensor, integer (or FP8) storage plus scale / zero point.

Represents x ~= (q - z) * s with q stored in the spec's storage dtype; s, z are per-tensor
(shape ()) or per-channel along `axis` (shape (C,)). It replaces torch's deprecated quantized
tensors (torch.quint8 / qint8 / qint32): creation by quantizing, from integers, accessors,
indexing with params following the slice, quantizing assignment, requantizing copy_,
transpose / permute, torch.save (weights_only=True) and safetensors, and conversion to and
from torch's own quantized tensors (quint8 <-> 8-bit unsigned, qint8 <-> 8-bit signed,
qint32 <-> 32-bit signed specs).

Quantizing uses netquant.core.ops.quantize: q = clamp(round(x * (1/s)) + z, qmin, qmax), except
the torch-signature constructors quantize_per_tensor / quantize_per_channel, which reproduce torch's
own int_repr bit for bit (see _quantize_torch_order). torch's CPU wheel 2.13 rounds the float32 sum
x * (1/s) + z instead; the two differ only where that sum's float32 rounding lands on a tie (about 1
element in 10^5 when z != 0). Other torch builds round first, as netquant does (torch_adds_zero_point_first).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields
from typing import Any

import torch

from netquant.atomic import write_bytes_atomic
from netquant.core import ops
from netquant.core.qparams import QParams, choose_qparams
from netquant.core.spec import Granularity, QuantFormat, QuantSpec, RoundingPolicy, ScaleConstraint
from netquant.errors import ConfigError, DataError

_BASIC_INDEX_TYPES = (int, slice, type(None), type(Ellipsis))

# torch's quantized dtypes <-> storage dtype and the spec we give such a tensor
_TORCH_QDTYPES = {torch.quint8: torch.uint8, torch.qint8: torch.int8, torch.qint32: torch.int32}
_STORAGE_TO_TORCH_QDTYPE = {v: k for k, v in _TORCH_QDTYPES.items()}


@contextlib.contextmanager
def _quiet_torch_quantized() -> Iterator[None]:
    """Silence torch 2.13's deprecation warnings for its quantized tensors (we only convert)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*quantiz.*deprecated", category=UserWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        yield


def _torch_dtype_spec(qdtype: torch.dtype, per_channel_axis: int | None, symmetric: bool) -> QuantSpec:
    """The spec matching a torch quantized dtype (full integer range, half-even rounding)."""
    signed = qdtype is not torch.quint8
    bits = 32 if qdtype is torch.qint32 else 8
    gran = {} if per_channel_axis is None else {"granularity": Granularity.PER_CHANNEL, "axis": per_channel_axis}
    return QuantSpec(bits=bits, signed=signed, symmetric=symmetric and signed, **gran)


@functools.cache
def torch_adds_zero_point_first(per_channel: bool) -> bool:
    """Whether this torch build's quantize_per_tensor (quantize_per_channel) rounds x/s + z rather than rounding
    x/s and then adding z: the tie x = 0.5, s = 1, z = 1 gives 2 (adds first: the torch 2.13 CPU wheel on x86) or
    1 (rounds first: torch 2.11's CUDA wheel on an AVX-512 Xeon). A torch without quantized tensors: True."""
    x = torch.tensor([0.5])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's deprecation of its quantized tensors
            q = (torch.quantize_per_channel(x, torch.ones(1, dtype=torch.float64), torch.ones(1, dtype=torch.long),
                                            0, torch.quint8) if per_channel else
                 torch.quantize_per_tensor(x, 1.0, 1, torch.quint8))
        return int(q.int_repr()[0]) == 2
    except (RuntimeError, AttributeError, NotImplementedError):
        return True


def _quantize_torch_order(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, spec: QuantSpec,
                          axis: int | None) -> torch.Tensor:
    """int_repr exactly as torch.quantize_per_tensor / quantize_per_channel compute it (8-bit dtypes).

    Where torch adds z before rounding (torch_adds_zero_point_first): per tensor
    q = clamp(round(fma(x, 1/s, z)), qmin, qmax) (one float32 rounding of x*(1/s)+z, as its vectorized fbgemm
    kernel does); per channel q = clamp(round(float32(x*(1/s)) + z), qmin, qmax). Half-even rounding, 1/s in
    float32. On exact ties with z != 0 this differs from `ops.quantize` (ONNX QuantizeLinear semantics: round,
    then add z), which is what a torch that rounds first gives. Non-finite values follow ops.quantize
    (+-Inf saturate, NaN -> qmin).
    """
    if not torch_adds_zero_point_first(axis is not None):
        return ops.quantize(x, scale, zero_point, spec)
    inv = torch.reciprocal(scale.to(torch.float32))
    z = zero_point.to(torch.float32)
    if axis is not None:
        shape = [1] * x.dim()
        shape[axis] = -1
        inv, z = inv.reshape(shape), z.reshape(shape)
        t = x.to(torch.float32) * inv + z
    else:
        t = (x.to(torch.float64) * inv.to(torch.float64) + z.to(torch.float64)).to(torch.float32)
    q = torch.round(t).clamp_(spec.qmin, spec.qmax)
    finite = torch.isfinite(x)
    if not bool(finite.all()):
        q = torch.where(finite, q, ops.quantize(x, scale, zero_point, spec).to(q.dtype))
    return q.to(spec.storage_dtype)


class QTensor:
    """Quantized tensor: storage q, scale s, zero point z (per-tensor or per-channel), spec.

    Dequantized value: x' = (q - z) * s (FP8: x' = q * s). Build it with `QTensor.quantize`,
    `QTensor.quantize_per_tensor` / `quantize_per_channel` (torch's signatures), `QTensor.from_int`
    or `QTensor.from_torch`.
    """

    __slots__ = ("_axis", "_data", "_scale", "_spec", "_zero_point")
    is_quantized = True

    def __init__(self, data: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | int,
                 spec: QuantSpec, axis: int | None = None) -> None:
        """Wrap integer (or FP8) storage. Validates dtype, range and params; casts integers to the storage dtype.

        The channel axis comes from a per-channel spec, or from `axis` (which makes a per-tensor spec per-channel).
        """
        if not isinstance(data, torch.Tensor):
            raise DataError(f"QTensor data must be a torch.Tensor, got {type(data).__name__}")
        self._init_format(spec, axis, data.dim())
        self._scale, self._zero_point = self._checked_params(scale, zero_point, data.shape, data.device)
        self._data = self._checked_storage(data)

    @classmethod
    def _quantized(cls, x: torch.Tensor, scale: Any, zero_point: Any, spec: QuantSpec,
                   axis: int | None = None, torch_order: bool = False) -> QTensor:
        """Quantize float x with the given params (validated) into a new QTensor.

        torch_order: round x/s + z as torch's quantize_per_tensor / per_channel do (8-bit storage).
        """
        out = cls.__new__(cls)
        out._init_format(spec, axis, x.dim())
        out._scale, out._zero_point = out._checked_params(scale, zero_point, x.shape, x.device)
        if torch_order and out._spec.bits == 8 and not out._spec.is_float:
            out._data = _quantize_torch_order(x, out._scale, out._zero_point, out._spec, out._axis)
        else:
            out._data = out._quantize_values(x)
        return out

    def _init_format(self, spec: QuantSpec, axis: int | None, ndim: int) -> None:
        """Set spec and axis; a per-channel spec's axis is normalised to 0..ndim-1."""
        if not isinstance(spec, QuantSpec):
            raise ConfigError(f"QTensor spec must be a QuantSpec, got {type(spec).__name__}")
        if spec.granularity is Granularity.PER_GROUP:
            raise ConfigError(f"QTensor holds per-tensor or per-channel params; spec ({spec.describe()}) is "
                              "per-group: use netquant.core.ops.quantize / dequantize for per-group data")
        if axis is None:
            axis = spec.axis
        elif spec.axis is not None and ndim and (axis - spec.axis) % ndim:
            raise ConfigError(f"axis={axis} disagrees with the spec's axis={spec.axis}")
        if axis is not None:
            if not -ndim <= axis < ndim:
                raise ConfigError(f"per-channel axis {axis} is out of range for a {ndim}-d tensor")
            axis %= ndim
            if spec.axis != axis:
                spec = spec.with_(granularity=Granularity.PER_CHANNEL, axis=axis)
        self._spec, self._axis = spec, axis

    # ---- validation ---------------------------------------------------------------
    def _checked_params(self, scale: Any, zero_point: Any, shape: torch.Size,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        scale = torch.as_tensor(scale, dtype=torch.float32, device=device).detach()
        zero_point = torch.as_tensor(zero_point, device=device).detach()
        if zero_point.is_floating_point() and not torch.equal(zero_point, zero_point.round()):
            raise DataError(f"QTensor zero_point must hold integers, got {zero_point.tolist()}")
        zero_point = zero_point.to(torch.int64)
        want = () if self._axis is None else (shape[self._axis],)
        if scale.shape == (1,) and want == ():
            scale, zero_point = scale.reshape(()), zero_point.reshape(())
        if tuple(scale.shape) != want or tuple(zero_point.shape) != want:
            kind = "per-tensor (shape ())" if self._axis is None else f"per-channel along axis {self._axis} (shape {want})"
            raise DataError(f"QTensor params must be {kind}; got scale {tuple(scale.shape)}, "
                            f"zero_point {tuple(zero_point.shape)} for data of shape {tuple(shape)}")
        if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
            raise DataError(f"QTensor scale must be finite and > 0, got {scale.tolist()}; "
                            "choose params with netquant.core.choose_qparams (it never returns 0, NaN or Inf)")
        if zero_point.numel() and self._spec.is_float and bool((zero_point != 0).any()):
            raise DataError(f"FP8 QTensors have zero point 0, got {zero_point.tolist()}")
        qmin, qmax = self.qrange
        if zero_point.numel() and not (qmin <= int(zero_point.min()) and int(zero_point.max()) <= qmax):
            raise DataError(f"QTensor zero_point {zero_point.tolist()} lies outside the integer range [{qmin}, {qmax}]")
        return scale, zero_point.to(torch.int32)

    def _checked_storage(self, data: torch.Tensor) -> torch.Tensor:
        storage = self.dtype
        if data.dtype == storage:
            if self.is_float:
                return data
        elif self.is_float:
            raise DataError(f"FP8 QTensor storage must be {storage}, got {data.dtype}; "
                            "use QTensor.quantize to quantize float values")
        elif data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
            raise DataError(f"QTensor storage must hold integers, got {data.dtype}; "
                            "use QTensor.quantize to quantize float values")
        qmin, qmax = self.qrange
        if data.numel() and not (qmin <= int(data.min()) and int(data.max()) <= qmax):
            raise DataError(f"QTensor integer values span [{int(data.min())}, {int(data.max())}], outside the "
                            f"range [{qmin}, {qmax}] of {self._describe_format()}")
        return data if data.dtype == storage else data.to(storage)

    # ---- construction -------------------------------------------------------------
    @classmethod
    def quantize(cls, x: torch.Tensor, spec: QuantSpec, params: QParams | None = None) -> QTensor:
        """Quantize float `x` with `spec`: q = clamp(round(x * (1/s)) + z, qmin, qmax) (FP8: cast(x / s)).

        Without `params`, they are chosen from x's min / max (per channel along spec.axis) with
        choose_qparams. NaN in x raises DataError; +-Inf saturates to qmax / qmin when params are given.
        """
        x = _float_input(x, "QTensor.quantize")
        if params is None:
            if spec.granularity is Granularity.PER_CHANNEL:
                if not -x.dim() <= spec.axis < x.dim():
                    raise ConfigError(f"per-channel axis {spec.axis} is out of range for a {x.dim()}-d tensor")
                axis = spec.axis % x.dim()
                dims = [d for d in range(x.dim()) if d != axis]
                flat = x.permute(axis, *dims).reshape(x.shape[axis], -1)
                lo, hi = (flat.amin(dim=1), flat.amax(dim=1)) if flat.shape[1] else (
                    torch.zeros(x.shape[axis], device=x.device), torch.zeros(x.shape[axis], device=x.device))
            elif x.numel():
                lo, hi = x.min(), x.max()
            else:
                lo = hi = torch.tensor(0.0)
            params = choose_qparams(lo, hi, spec)
        return cls._quantized(x, params.scale, params.zero_point, spec)

    @classmethod
    def quantize_per_tensor(cls, x: torch.Tensor, scale: float, zero_point: int,
                            dtype: torch.dtype = torch.quint8) -> QTensor:
        """torch.quantize_per_tensor's signature; dtype torch.quint8 / qint8 / qint32 (or uint8 / int8 / int32)."""
        qdtype = _as_torch_qdtype(dtype)
        spec = _torch_dtype_spec(qdtype, None, symmetric=False)
        x = _float_input(x, "QTensor.quantize_per_tensor")
        return cls._quantized(x, scale, zero_point, spec, torch_order=True)

    @classmethod
    def quantize_per_channel(cls, x: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor, axis: int,
                             dtype: torch.dtype = torch.quint8) -> QTensor:
        """torch.quantize_per_channel's signature; dtype torch.quint8 / qint8 / qint32 (or uint8 / int8 / int32)."""
        qdtype = _as_torch_qdtype(dtype)
        x = _float_input(x, "QTensor.quantize_per_channel")
        if x.dim() == 0:
            raise DataError("cannot quantize a 0-d tensor per channel")
        axis %= x.dim()
        spec = _torch_dtype_spec(qdtype, axis, symmetric=False)
        return cls._quantized(x, scales, zero_points, spec, axis=axis, torch_order=True)

    @classmethod
    def from_int(cls, data: torch.Tensor, scale: torch.Tensor | float, zero_point: torch.Tensor | int,
                 spec: QuantSpec | None = None, axis: int | None = None) -> QTensor:
        """From integer values plus params (torch._make_per_tensor/_per_channel_quantized_tensor).

        Without a spec: uint8 data -> 8-bit unsigned affine, int8 -> 8-bit signed, int32 -> 32-bit signed;
        `axis` makes it per-channel.
        """
        if spec is None:
            if not isinstance(data, torch.Tensor) or data.dtype not in _STORAGE_TO_TORCH_QDTYPE:
                raise ConfigError(f"QTensor.from_int: give a spec for "
                                  f"{data.dtype if isinstance(data, torch.Tensor) else type(data).__name__} data "
                                  "(only uint8, int8 and int32 data imply one)")
            spec = _torch_dtype_spec(_STORAGE_TO_TORCH_QDTYPE[data.dtype], None, symmetric=False)
        return cls(data, scale, zero_point, spec, axis=axis)

    @classmethod
    def from_torch(cls, t: torch.Tensor) -> QTensor:
        """From torch's own quantized tensor (quint8 / qint8 / qint32, per-tensor or per-channel).

        The scale is stored as float32 (torch keeps float64); torch's kernels use float32 scales too.
        """
        if not isinstance(t, torch.Tensor) or not t.is_quantized:
            raise DataError(f"QTensor.from_torch needs a torch quantized tensor, got "
                            f"{t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.dtype not in _TORCH_QDTYPES:
            raise ConfigError(f"QTensor.from_torch supports torch.quint8, qint8 and qint32, got {t.dtype}")
        with _quiet_torch_quantized():
            scheme = t.qscheme()
            data = t.int_repr()
            if scheme in (torch.per_tensor_affine, torch.per_tensor_symmetric):
                scale, zp, axis = torch.tensor(t.q_scale()), torch.tensor(t.q_zero_point()), None
            elif scheme in (torch.per_channel_affine, torch.per_channel_symmetric):
                scale, zp = t.q_per_channel_scales(), t.q_per_channel_zero_points()
                axis = t.q_per_channel_axis()
            else:
                raise ConfigError(f"QTensor.from_torch: quantization scheme {scheme} (float zero points) "
                                  "is not supported; dequantize() it and use QTensor.quantize")
        symmetric = bool((zp == 0).all())
        return cls(data, scale.float(), zp, _torch_dtype_spec(t.dtype, axis, symmetric), axis=axis)

    def to_torch(self) -> torch.Tensor:
        """To torch's quantized tensor (uint8 storage -> quint8, int8 -> qint8, int32 -> qint32)."""
        qdtype = _STORAGE_TO_TORCH_QDTYPE.get(self.dtype)
        if qdtype is None:
            raise ConfigError(f"torch has no quantized dtype for {self._describe_format()} ({self.dtype} storage); "
                              "only uint8, int8 and int32 storage convert")
        with _quiet_torch_quantized():
            if self._axis is None:
                return torch._make_per_tensor_quantized_tensor(
                    self._data.clone(), float(self._scale), int(self._zero_point))
            return torch._make_per_channel_quantized_tensor(
                self._data.contiguous().clone(), self._scale.double(), self._zero_point.long(), self._axis)

    # ---- numerics -----------------------------------------------------------------
    def _quantize_values(self, x: torch.Tensor) -> torch.Tensor:
        """Quantize float values of this tensor's shape with this tensor's params and spec."""
        return ops.quantize(_float_input(x, "QTensor"), self._scale, self._zero_point, self._spec)

    def dequantize(self) -> torch.Tensor:
        """x' = (q - z) * s as float32 (FP8: q * s)."""
        return ops.dequantize(self._data, self._scale, self._zero_point, self._spec)

    # ---- accessors ----------------------------------------------------------------
    @property
    def spec(self) -> QuantSpec:
        """The spec: format, integer range, rounding; granularity and axis match this tensor."""
        return self._spec

    @property
    def scale(self) -> torch.Tensor:
        """float32 scale, shape () or (C,)."""
        return self._scale

    @property
    def zero_point(self) -> torch.Tensor:
        """int32 zero point, shape () or (C,)."""
        return self._zero_point

    @property
    def params(self) -> QParams:
        return QParams(scale=self._scale, zero_point=self._zero_point)

    @property
    def axis(self) -> int | None:
        """Per-channel axis, None for per-tensor."""
        return self._axis

    @property
    def is_per_channel(self) -> bool:
        return self._axis is not None

    @property
    def is_float(self) -> bool:
        """True for FP8 storage."""
        return self._spec.is_float

    @property
    def qrange(self) -> tuple[int, int]:
        """(qmin, qmax) of the integer storage (FP8: -fmax, fmax)."""
        if self._spec.is_float:
            return -int(self._spec.fp_max), int(self._spec.fp_max)
        return self._spec.qmin, self._spec.qmax

    @property
    def dtype(self) -> torch.dtype:
        """Storage dtype (int8, uint8, int16, int32 or an FP8 dtype)."""
        return self._spec.storage_dtype

    @property
    def device(self) -> torch.device:
        return self._data.device

    @property
    def shape(self) -> torch.Size:
        return self._data.shape

    @property
    def ndim(self) -> int:
        return self._data.dim()

    def dim(self) -> int:
        return self._data.dim()

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self._data.size() if dim is None else self._data.size(dim)

    def numel(self) -> int:
        return self._data.numel()

    def __len__(self) -> int:
        return len(self._data)

    def int_repr(self) -> torch.Tensor:
        """A copy of the stored values (integers; FP8 values for FP8 QTensors)."""
        return self._data.clone()

    def item(self) -> float:
        """The dequantized value of a one-element QTensor."""
        if self._data.numel() != 1:
            raise DataError(f"item() needs a QTensor with one element, this one has shape {tuple(self.shape)}")
        return self.dequantize().item()

    def q_scale(self) -> float:
        self._require_per_tensor("q_scale")
        return float(self._scale)

    def q_zero_point(self) -> int:
        self._require_per_tensor("q_zero_point")
        return int(self._zero_point)

    def q_per_channel_scales(self) -> torch.Tensor:
        self._require_per_channel("q_per_channel_scales")
        return self._scale.clone()

    def q_per_channel_zero_points(self) -> torch.Tensor:
        self._require_per_channel("q_per_channel_zero_points")
        return self._zero_point.long()

    def q_per_channel_axis(self) -> int:
        self._require_per_channel("q_per_channel_axis")
        return int(self._axis)  # type: ignore[arg-type]

    def qscheme(self) -> torch.qscheme:
        return torch.per_tensor_affine if self._axis is None else torch.per_channel_affine

    def _require_per_tensor(self, what: str) -> None:
        if self._axis is not None:
            raise ConfigError(f"{what}() is for per-tensor QTensors; this one is per-channel along axis "
                              f"{self._axis}: use q_per_channel_scales() / q_per_channel_zero_points()")

    def _require_per_channel(self, what: str) -> None:
        if self._axis is None:
            raise ConfigError(f"{what}() is for per-channel QTensors; this one is per-tensor: "
                              "use q_scale() / q_zero_point()")

    # ---- indexing -----------------------------------------------------------------
    def _with(self, data: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int | None) -> QTensor:
        """A QTensor sharing this one's format, with new storage/params/axis (no validation of values)."""
        out = QTensor.__new__(QTensor)
        spec = self._spec
        if axis is None and spec.granularity is not Granularity.PER_TENSOR:
            spec = spec.with_(granularity=Granularity.PER_TENSOR, axis=None)
        elif axis is not None and spec.axis != axis:
            spec = spec.with_(granularity=Granularity.PER_CHANNEL, axis=axis)
        out._spec, out._axis = spec, axis
        out._data, out._scale, out._zero_point = data, scale, zero_point
        return out

    def __getitem__(self, index: Any) -> QTensor:
        """Index like a tensor; per-channel params follow the slice (an int on the axis -> per-tensor)."""
        data = self._data[index]
        if self._axis is None:
            return self._with(data, self._scale, self._zero_point, None)
        idx = index if isinstance(index, tuple) else (index,)
        if all(isinstance(i, _BASIC_INDEX_TYPES) and not isinstance(i, bool) for i in idx):
            new_axis, channels = _follow_axis_basic(idx, self._data.dim(), self._axis)
        else:
            new_axis, channels = self._axis_from_channel_ids(self._channel_ids()[index], "indexing")
        return self._with(data, self._scale[channels], self._zero_point[channels], new_axis)

    def _channel_ids(self) -> torch.Tensor:
        """Each element's channel index (an expanded view, shape self.shape)."""
        n = self._data.shape[self._axis]
        return torch.arange(n, device=self._data.device).reshape(
            [-1 if d == self._axis else 1 for d in range(self._data.dim())]).expand(self._data.shape)

    def _axis_from_channel_ids(self, ids: torch.Tensor, what: str) -> tuple[int | None, Any]:
        """(new axis, channel selector) for a result whose elements come from channels `ids`.

        Channels must vary along at most one dim (that dim becomes the axis); none -> per-tensor.
        """
        if ids.numel() == 0:
            return None, 0  # empty result: any channel's params describe it
        varying = [d for d in range(ids.dim()) if bool((ids != ids.narrow(d, 0, 1)).any())]
        if not varying:
            return None, int(ids.reshape(-1)[0])
        if len(varying) == 1:
            d = varying[0]
            line = ids.movedim(d, -1).reshape(-1, ids.shape[d])[0]
            if bool((ids == line.reshape([-1 if k == d else 1 for k in range(ids.dim())])).all()):
                return d, line
        raise DataError(f"{what} this per-channel QTensor (axis {self._axis}, shape {tuple(self.shape)}) "
                        f"mixes channels across dims {varying}; dequantize() first or keep the channel axis whole")

    def __setitem__(self, index: Any, value: Any) -> None:
        """Assign floats (or a QTensor's dequantized values); they are quantized with each element's params."""
        target = self[index]
        values = value.dequantize() if isinstance(value, QTensor) else torch.as_tensor(
            value, dtype=torch.float32, device=self.device)
        values = _float_input(values, "QTensor assignment")
        try:
            values = values.broadcast_to(target.shape)
        except RuntimeError as err:
            raise DataError(f"cannot assign a value of shape {tuple(values.shape)} to a QTensor slice of shape "
                            f"{tuple(target.shape)}") from err
        self._data[index] = target._quantize_values(values)

    def copy_(self, src: QTensor | torch.Tensor) -> QTensor:
        """Copy src's values into self, requantized with self's params (src broadcasts to self's shape)."""
        values = src.dequantize() if isinstance(src, QTensor) else _float_input(src, "QTensor.copy_")
        try:
            values = values.to(self.device).broadcast_to(self.shape)
        except RuntimeError as err:
            raise DataError(f"QTensor.copy_: source shape {tuple(values.shape)} does not broadcast to "
                            f"{tuple(self.shape)}") from err
        self._data.copy_(self._quantize_values(values))
        return self

    # ---- layout -------------------------------------------------------------------
    def transpose(self, dim0: int, dim1: int) -> QTensor:
        """Swap two dims; the channel axis follows."""
        n = max(self.ndim, 1)
        dim0, dim1 = dim0 % n, dim1 % n
        axis = self._axis
        if axis is not None:
            axis = dim1 if axis == dim0 else dim0 if axis == dim1 else axis
        return self._with(self._data.transpose(dim0, dim1), self._scale, self._zero_point, axis)

    def permute(self, *dims: int | Sequence[int]) -> QTensor:
        """Reorder dims; the channel axis follows."""
        order = list(dims[0]) if len(dims) == 1 and isinstance(dims[0], Sequence) else list(dims)
        data = self._data.permute(*order)
        axis = None if self._axis is None else [d % self.ndim for d in order].index(self._axis)
        return self._with(data, self._scale, self._zero_point, axis)

    def reshape(self, *shape: int | Sequence[int]) -> QTensor:
        """Reshape; per-channel params follow when the channels still run along one dim."""
        size = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], Sequence) else shape
        data = self._data.reshape(size)
        if self._axis is None:
            return self._with(data, self._scale, self._zero_point, None)
        axis, channels = self._axis_from_channel_ids(self._channel_ids().reshape(data.shape), "reshaping")
        return self._with(data, self._scale[channels], self._zero_point[channels], axis)

    def contiguous(self) -> QTensor:
        return self._with(self._data.contiguous(), self._scale, self._zero_point, self._axis)

    def clone(self) -> QTensor:
        return self._with(self._data.clone(), self._scale.clone(), self._zero_point.clone(), self._axis)

    def to(self, device: torch.device | str) -> QTensor:
        """Move storage and params to a device."""
        return self._with(self._data.to(device), self._scale.to(device), self._zero_point.to(device), self._axis)

    # ---- equality, repr ------------------------------------------------------------
    def equal(self, other: QTensor) -> bool:
        """Same format, axis, params and stored values."""
        return (isinstance(other, QTensor) and self._spec == other._spec and self._axis == other._axis
                and self.shape == other.shape and torch.equal(self._scale, other._scale)
                and torch.equal(self._zero_point, other._zero_point)
                and torch.equal(_comparable(self._data), _comparable(other._data)))

    def _describe_format(self) -> str:
        return self._spec.describe()

    def __repr__(self) -> str:
        values = repr(self.dequantize())
        values = values[len("tensor("):-1] if values.startswith("tensor(") else values
        if self._axis is None:
            params = f"scale={float(self._scale):.6g}, zero_point={int(self._zero_point)}"
        else:
            params = f"axis={self._axis}, scale={_short(self._scale)}, zero_point={_short(self._zero_point)}"
        return (f"QTensor({values}, size={tuple(self.shape)}, dtype={str(self.dtype).replace('torch.', '')}, "
                f"spec=({self._describe_format()}), {params})")

    # ---- serialisation --------------------------------------------------------------
    def to_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(tensors, meta): plain tensors 'qdata', 'scale', 'zero_point' and JSON-able metadata."""
        data = self._data.contiguous()
        if data.untyped_storage().nbytes() != data.numel() * data.element_size():
            data = data.clone()  # a view: store only its elements
        tensors = {"qdata": data, "scale": self._scale, "zero_point": self._zero_point}
        return tensors, {"spec": _spec_to_dict(self._spec), "axis": self._axis}

    @classmethod
    def from_state(cls, tensors: Mapping[str, torch.Tensor], meta: Mapping[str, Any]) -> QTensor:
        """Inverse of to_state (validates everything)."""
        try:
            spec = _spec_from_dict(meta["spec"])
            return cls(tensors["qdata"], tensors["scale"], tensors["zero_point"], spec, axis=meta["axis"])
        except KeyError as err:
            raise DataError(f"QTensor state is missing {err}") from err

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, tuple[Any, ...]]:
        # plain tensors + primitives, rebuilt by a function registered as a torch.load safe global
        tensors, meta = self.to_state()
        return _rebuild_qtensor, (tensors["qdata"], tensors["scale"], tensors["zero_point"], meta["spec"], meta["axis"])


def _rebuild_qtensor(qdata: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor,
                     spec: dict[str, Any], axis: int | None) -> QTensor:
    """Unpickling entry point (safe for torch.load(weights_only=True))."""
    return QTensor(qdata, scale, zero_point, _spec_from_dict(spec), axis=axis)


torch.serialization.add_safe_globals([_rebuild_qtensor])


# ---- helpers -----------------------------------------------------------------------------
def _float_input(x: Any, where: str) -> torch.Tensor:
    """A float32 tensor without NaN (NaN has no quantized value)."""
    if not isinstance(x, torch.Tensor):
        x = torch.as_tensor(x, dtype=torch.float32)
    if x.is_quantized:
        raise DataError(f"{where}: got a torch quantized tensor; convert it with QTensor.from_torch")
    if not x.is_floating_point():
        x = x.to(torch.float32)
    elif x.dtype != torch.float32:
        x = x.float()
    x = x.detach()
    nan = int(torch.isnan(x).sum()) if x.numel() else 0
    if nan:
        raise DataError(f"{where}: input holds {nan} NaN value(s) of {x.numel()}; NaN has no quantized value, "
                        "replace it (torch.nan_to_num) first")
    return x


def _short(p: torch.Tensor, limit: int = 8) -> str:
    """A param vector as a short list: all values, or the first and last few."""
    fmt = (lambda v: f"{v:.6g}") if p.is_floating_point() else str
    values = p.tolist()
    if len(values) > limit:
        return "[" + ", ".join(map(fmt, values[:3])) + ", ..., " + ", ".join(map(fmt, values[-3:])) + "]"
    return "[" + ", ".join(map(fmt, values)) + "]"


def _comparable(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def _as_torch_qdtype(dtype: torch.dtype) -> torch.dtype:
    if dtype in _TORCH_QDTYPES:
        return dtype
    if dtype in _STORAGE_TO_TORCH_QDTYPE:
        return _STORAGE_TO_TORCH_QDTYPE[dtype]
    raise ConfigError(f"dtype must be torch.quint8, qint8 or qint32 (or uint8, int8, int32), got {dtype}")


def _follow_axis_basic(index: tuple[Any, ...], ndim: int, axis: int) -> tuple[int | None, Any]:
    """(new axis or None, channel selector) for an index of ints, slices, None and Ellipsis."""
    consumed = sum(isinstance(i, int | slice) for i in index)
    if sum(i is Ellipsis for i in index) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    expanded: list[Any] = []
    for i in index:
        expanded.extend([slice(None)] * (ndim - consumed) if i is Ellipsis else [i])
    in_dim = out_dim = 0
    for i in expanded:
        if i is None:
            out_dim += 1
            continue
        if in_dim == axis:
            return (None, i) if isinstance(i, int) else (out_dim, i)
        in_dim += 1
        out_dim += int(isinstance(i, slice))
    return out_dim + (axis - in_dim), slice(None)


_SPEC_ENUMS = {"granularity": Granularity, "scale_constraint": ScaleConstraint,
               "rounding": RoundingPolicy, "fmt": QuantFormat}


def _spec_to_dict(spec: QuantSpec) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(spec):
        value = getattr(spec, f.name)
        out[f.name] = value.value if f.name in _SPEC_ENUMS else value
    return out


def _spec_from_dict(d: Mapping[str, Any]) -> QuantSpec:
    if not isinstance(d, Mapping):
        raise DataError(f"stored QTensor spec must be a mapping, got {type(d).__name__}")
    try:
        kw = {k: (_SPEC_ENUMS[k](v) if k in _SPEC_ENUMS else v) for k, v in d.items()}
        return QuantSpec(**kw)
    except (TypeError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise DataError(f"stored QTensor spec {dict(d)} is malformed: {err}") from err


# ---- safetensors -------------------------------------------------------------------------
_META_PREFIX = "netquant.qtensor:"


def save_safetensors(tensors: Mapping[str, QTensor | torch.Tensor], path: str | os.PathLike[str],
                     metadata: Mapping[str, str] | None = None) -> None:
    """Write QTensors (as '<name>.qdata', '<name>.scale', '<name>.zero_point' + JSON metadata) and plain
    tensors to a safetensors file, whole or not at all."""
    from safetensors.torch import save

    flat: dict[str, torch.Tensor] = {}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    for name, t in tensors.items():
        if isinstance(t, QTensor):
            parts, info = t.to_state()
            meta[_META_PREFIX + name] = json.dumps(info, sort_keys=True)
            items = {f"{name}.{k}": v for k, v in parts.items()}
        elif isinstance(t, torch.Tensor):
            items = {name: t}
        else:
            raise DataError(f"save_safetensors: {name!r} is a {type(t).__name__}, not a QTensor or torch.Tensor")
        for key, value in items.items():
            if key in flat:
                raise DataError(f"save_safetensors: tensor name {key!r} is used twice; rename {name!r}")
            flat[key] = value.detach().contiguous().clone()
    payload = save(flat, metadata=meta)
    write_bytes_atomic(path, payload, "safetensors file", DataError)


def load_safetensors(path: str | os.PathLike[str], device: str = "cpu") -> dict[str, QTensor | torch.Tensor]:
    """Read a file written by save_safetensors: QTensors rebuilt, other tensors as they are."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    try:
        with safe_open(str(path), framework="pt", device=device) as f:
            meta = f.metadata() or {}
            flat = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    except (SafetensorError, OSError) as err:
        raise DataError(f"cannot read safetensors file {path}: {err}") from err
    out: dict[str, QTensor | torch.Tensor] = {}
    for key, value in meta.items():
        if not key.startswith(_META_PREFIX):
            continue
        name = key[len(_META_PREFIX):]
        try:
            info = json.loads(value)
            parts = {p: flat.pop(f"{name}.{p}") for p in ("qdata", "scale", "zero_point")}
        except (json.JSONDecodeError, KeyError) as err:
            raise DataError(f"{path}: QTensor {name!r} is malformed ({err}); the file is damaged") from err
        try:
            out[name] = QTensor.from_state(parts, info)
        except (DataError, ConfigError) as err:
            raise DataError(f"{path}: QTensor {name!r}: {err}") from err
    out.update(flat)
    return out
