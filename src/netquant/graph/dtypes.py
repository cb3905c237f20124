"""ONNX element types <-> torch dtypes, and TensorProto <-> torch.Tensor without loss.

Types torch cannot compute with (int4, uint4, int2, uint2, float4e2m1, float6) are held in a stand-in
torch dtype (int8 / uint8 / float32) holding the same values; callers keep the ONNX type next to the
tensor (Graph.initializer_types) so it is written back with its original type.  Strings have no torch
dtype: they come back as numpy object arrays.
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from onnx import TensorProto, numpy_helper

from netquant.errors import ModelError

_T = TensorProto
ONNX_TO_TORCH: dict[int, torch.dtype] = {
    _T.FLOAT: torch.float32, _T.UINT8: torch.uint8, _T.INT8: torch.int8, _T.UINT16: torch.uint16,
    _T.INT16: torch.int16, _T.INT32: torch.int32, _T.INT64: torch.int64, _T.BOOL: torch.bool,
    _T.FLOAT16: torch.float16, _T.DOUBLE: torch.float64, _T.UINT32: torch.uint32, _T.UINT64: torch.uint64,
    _T.COMPLEX64: torch.complex64, _T.COMPLEX128: torch.complex128, _T.BFLOAT16: torch.bfloat16,
    _T.FLOAT8E4M3FN: torch.float8_e4m3fn, _T.FLOAT8E4M3FNUZ: torch.float8_e4m3fnuz,
    _T.FLOAT8E5M2: torch.float8_e5m2, _T.FLOAT8E5M2FNUZ: torch.float8_e5m2fnuz,
    _T.FLOAT8E8M0: torch.float8_e8m0fnu,
}
TORCH_TO_ONNX: dict[torch.dtype, int] = {v: k for k, v in ONNX_TO_TORCH.items()}

# sub-byte types held in a wider torch dtype with identical values
STAND_IN: dict[int, torch.dtype] = {
    _T.UINT4: torch.uint8, _T.INT4: torch.int8, _T.UINT2: torch.uint8, _T.INT2: torch.int8,
    _T.FLOAT4E2M1: torch.float32, _T.FLOAT6E2M3: torch.float32, _T.FLOAT6E3M2: torch.float32,
}
# the sub-byte types the ops compute with (Cast, Q/DQ); float6 is only loaded and saved
COMPUTED_STAND_IN: dict[int, torch.dtype] = {t: STAND_IN[t] for t in (_T.UINT4, _T.INT4, _T.FLOAT4E2M1, _T.UINT2, _T.INT2)}
# integer range of each sub-byte integer type
SUB_BYTE_RANGE: dict[int, tuple[int, int]] = {_T.UINT4: (0, 15), _T.INT4: (-8, 7), _T.UINT2: (0, 3), _T.INT2: (-2, 1)}

# numpy dtypes torch.from_numpy handles directly
_NUMPY_NATIVE = {np.dtype(t) for t in (np.float32, np.float64, np.float16, np.int8, np.int16, np.int32,
                                       np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_,
                                       np.complex64, np.complex128)}
# ml_dtypes names -> (bit-view numpy dtype, torch dtype) for byte-sized exotic floats
BITCAST_DTYPES = {
    "bfloat16": (np.uint16, torch.bfloat16),
    "float8_e4m3fn": (np.uint8, torch.float8_e4m3fn),
    "float8_e4m3fnuz": (np.uint8, torch.float8_e4m3fnuz),
    "float8_e5m2": (np.uint8, torch.float8_e5m2),
    "float8_e5m2fnuz": (np.uint8, torch.float8_e5m2fnuz),
    "float8_e8m0fnu": (np.uint8, torch.float8_e8m0fnu),
}


def onnx_type_name(elem_type: int) -> str:
    try:
        return TensorProto.DataType.Name(elem_type)
    except ValueError:
        return f"<elem_type {elem_type}>"


def torch_dtype(elem_type: int | None) -> torch.dtype | None:
    """torch dtype computing with values of an ONNX element type (None for strings / unknown)."""
    if elem_type is None:
        return None
    return ONNX_TO_TORCH.get(elem_type) or STAND_IN.get(elem_type)


def onnx_elem_type(dtype: torch.dtype) -> int:
    if dtype not in TORCH_TO_ONNX:
        raise ModelError(f"torch dtype {dtype} has no ONNX element type")
    return TORCH_TO_ONNX[dtype]


def numpy_to_torch(array: np.ndarray) -> torch.Tensor:
    """numpy (including ml_dtypes bfloat16 / float8 / int4) -> torch tensor, same values and bits."""
    arr = np.asarray(array)
    if arr.dtype in _NUMPY_NATIVE:
        return torch.from_numpy(np.array(arr, order="C", copy=True))
    name = arr.dtype.name
    if name in BITCAST_DTYPES:
        view, dtype = BITCAST_DTYPES[name]
        return torch.from_numpy(np.array(arr, order="C", copy=True).view(view)).view(dtype)
    if name in ("int4", "int2"):
        return torch.from_numpy(arr.astype(np.int8))
    if name in ("uint4", "uint2"):
        return torch.from_numpy(arr.astype(np.uint8))
    if name.startswith("float4") or name.startswith("float6"):
        return torch.from_numpy(arr.astype(np.float32))
    raise ModelError(f"numpy dtype {arr.dtype} cannot be held in a torch tensor")


def torch_to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """torch -> numpy; bfloat16 / float8 become ml_dtypes arrays (same bits)."""
    t = tensor.detach().cpu().contiguous()
    for name, (view, dtype) in BITCAST_DTYPES.items():
        if t.dtype == dtype:
            import ml_dtypes

            bits = t.view(torch.int16 if view == np.uint16 else torch.uint8).numpy().view(view)
            return bits.view(getattr(ml_dtypes, name))
    if t.dtype == torch.uint16:
        return t.view(torch.int16).numpy().view(np.uint16)
    if t.dtype == torch.uint32:
        return t.view(torch.int32).numpy().view(np.uint32)
    if t.dtype == torch.uint64:
        return t.view(torch.int64).numpy().view(np.uint64)
    return t.numpy()


_ML_DTYPE_OF = {_T.UINT4: "uint4", _T.INT4: "int4", _T.UINT2: "uint2", _T.INT2: "int2",
                _T.FLOAT4E2M1: "float4_e2m1fn", _T.FLOAT6E2M3: "float6_e2m3fn", _T.FLOAT6E3M2: "float6_e3m2fn"}


def numpy_as_onnx_type(array: np.ndarray, elem_type: int | None) -> np.ndarray:
    """Convert a stand-in array (int8 for INT4, ...) to the ml_dtypes type of elem_type."""
    name = _ML_DTYPE_OF.get(elem_type or 0)
    if name is None:
        return array
    import ml_dtypes

    return array.astype(getattr(ml_dtypes, name))


def tensor_from_proto(proto: TensorProto, where: str = "") -> tuple[torch.Tensor | np.ndarray, int]:
    """(values, onnx elem type).  Strings come back as a numpy object array."""
    try:
        arr = numpy_helper.to_array(proto)
    except Exception as exc:  # malformed raw_data, missing external file, ...
        raise ModelError(f"{where or 'tensor'} '{proto.name}': cannot decode tensor data "
                         f"({onnx_type_name(proto.data_type)}, dims {list(proto.dims)}): {exc}") from exc
    if proto.data_type == TensorProto.STRING:
        return arr, proto.data_type
    return numpy_to_torch(arr), proto.data_type


def tensor_to_proto(value: torch.Tensor | np.ndarray, name: str = "", elem_type: int | None = None,
                    into: TensorProto | None = None) -> TensorProto:
    """torch (or numpy object array of strings) -> TensorProto; elem_type overrides a stand-in dtype.
    into: an empty TensorProto to fill (e.g. `graph.initializer.add()`: no copy of the data into a repeated field)."""
    if isinstance(value, np.ndarray) and value.dtype == object:
        return _filled(into, numpy_helper.from_array(value, name))
    t = value if isinstance(value, torch.Tensor) else numpy_to_torch(value)
    t = t.detach().cpu().contiguous()
    if elem_type is not None and elem_type in STAND_IN:
        vals = t.reshape(-1).tolist()
        return _filled(into, onnx.helper.make_tensor(name, elem_type, list(t.shape), vals))
    proto = TensorProto() if into is None else into
    if name:
        proto.name = name
    proto.dims.extend(t.shape)
    proto.data_type = onnx_elem_type(t.dtype) if elem_type is None else elem_type
    if t.dtype == torch.bool:
        proto.raw_data = t.reshape(-1).to(torch.uint8).numpy().tobytes()
    elif t.numel() == 0:
        proto.raw_data = b""
    else:
        proto.raw_data = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return proto


def _filled(into: TensorProto | None, proto: TensorProto) -> TensorProto:
    if into is None:
        return proto
    into.CopyFrom(proto)
    return into
