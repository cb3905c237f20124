"""FlatbufferWriter: tensors, constant buffers and operators of one TFLite subgraph, packed as a "TFL3" file.

Quantized tensors carry QuantizationParameters (scale, zero point, quantized dimension): real = scale * (q - zp).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from netquant.errors import ExportError
from netquant.export.tflite.schema import schema

# numpy dtype -> TensorType value
_TYPES = {np.dtype(np.float32): 0, np.dtype(np.int32): 2, np.dtype(np.uint8): 3, np.dtype(np.int64): 4,
          np.dtype(np.bool_): 6, np.dtype(np.int16): 7, np.dtype(np.int8): 9}

# (op, int8) -> operator version the int8 kernels were introduced with (others: 1)
_INT8_VERSIONS = {"CONV_2D": 3, "DEPTHWISE_CONV_2D": 3, "FULLY_CONNECTED": 4, "ADD": 2, "SUB": 2, "MUL": 2,
                  "AVERAGE_POOL_2D": 2, "MAX_POOL_2D": 2, "MEAN": 2, "CONCATENATION": 2, "SOFTMAX": 2,
                  "LOGISTIC": 2, "TRANSPOSE": 2, "STRIDED_SLICE": 2, "QUANTIZE": 2, "DEQUANTIZE": 2,
                  "RELU": 2, "RELU6": 2, "BATCH_MATMUL": 2, "SQUEEZE": 1, "RESHAPE": 1, "HARD_SWISH": 1}


@dataclass(frozen=True)
class Quant:
    """Affine int quantization of one tensor: per-tensor (axis None) or per-channel along `axis`."""

    scale: tuple[float, ...]
    zero_point: tuple[int, ...]
    axis: int | None = None

    @staticmethod
    def of(scale: Any, zero_point: Any, axis: int | None = None) -> Quant:
        s = np.asarray(scale, dtype=np.float32).reshape(-1)
        z = np.asarray(zero_point, dtype=np.int64).reshape(-1)
        return Quant(tuple(float(v) for v in s), tuple(int(v) for v in z), axis if s.size > 1 else None)


@dataclass
class Tensor:
    index: int
    shape: tuple[int, ...]
    dtype: np.dtype
    quant: Quant | None
    name: str


class FlatbufferWriter:
    """One subgraph: add_tensor / add_const / add_op, then to_bytes()."""

    def __init__(self) -> None:
        self.s = schema()
        self.tensors: list[Any] = []
        self.info: list[Tensor] = []
        self.buffers: list[Any] = [self.s.BufferT()]  # buffer 0: empty, by convention
        self.opcodes: dict[tuple[str, int], int] = {}
        self.operators: list[Any] = []
        self.op_types: list[tuple[str, bool]] = []  # (op name, int8) of every operator
        self.names: set[str] = set()
        self.inputs: list[int] = []
        self.outputs: list[int] = []

    def _fresh(self, name: str) -> str:
        base, i = name, 1
        while name in self.names:
            name, i = f"{base}_{i}", i + 1
        self.names.add(name)
        return name

    def add_tensor(self, name: str, shape: Sequence[int], dtype: Any, quant: Quant | None = None,
                   data: np.ndarray | None = None) -> Tensor:
        dt = np.dtype(dtype)
        if dt not in _TYPES:
            raise ExportError(f"TFLite export: tensor '{name}' has dtype {dt}, which the writer cannot store")
        t = self.s.TensorT()
        t.shape = [int(d) for d in shape]
        t.type = _TYPES[dt]
        t.name = self._fresh(name)
        if data is not None:
            arr = np.array(data, dtype=dt, order="C")
            if tuple(arr.shape) != tuple(t.shape):
                raise ExportError(f"TFLite export: constant '{name}' has shape {arr.shape}, expected {tuple(shape)}")
            buf = self.s.BufferT()
            buf.data = np.frombuffer(arr.tobytes(), dtype=np.uint8)
            self.buffers.append(buf)
            t.buffer = len(self.buffers) - 1
        if quant is not None:
            q = self.s.QuantizationParametersT()
            q.scale = list(quant.scale)
            q.zeroPoint = list(quant.zero_point)
            q.quantizedDimension = int(quant.axis or 0)
            t.quantization = q
        self.tensors.append(t)
        info = Tensor(len(self.tensors) - 1, tuple(t.shape), dt, quant, t.name)
        self.info.append(info)
        return info

    def rename(self, tensor: Tensor, name: str) -> None:
        """Give `tensor` a fresh name based on `name` (the old one becomes free)."""
        self.names.discard(self.tensors[tensor.index].name)
        new = self._fresh(name)
        self.tensors[tensor.index].name = new
        tensor.name = new

    def add_const(self, name: str, data: np.ndarray, quant: Quant | None = None) -> Tensor:
        arr = np.asarray(data)
        return self.add_tensor(name, arr.shape, arr.dtype, quant, arr)

    def add_op(self, op: str, inputs: Sequence[Tensor | None], outputs: Sequence[Tensor],
               options: Any = None, options_type: str | None = None) -> None:
        """Append operator BuiltinOperator.<op>; options: a <X>OptionsT object (its BuiltinOptions type is
        found from its class name unless `options_type` names it)."""
        if not hasattr(self.s.BuiltinOperator, op):
            raise ExportError(f"TFLite schema has no builtin operator {op}")
        is_int8 = any(t is not None and t.dtype == np.int8 and t.quant is not None
                      for t in [*inputs, *outputs]) and op not in ("QUANTIZE", "DEQUANTIZE")
        version = _INT8_VERSIONS.get(op, 1) if is_int8 or op in ("QUANTIZE", "DEQUANTIZE") else 1
        key = (op, version)
        if key not in self.opcodes:
            self.opcodes[key] = len(self.opcodes)
        o = self.s.OperatorT()
        o.opcodeIndex = self.opcodes[key]
        o.inputs = [-1 if t is None else t.index for t in inputs]
        o.outputs = [t.index for t in outputs]
        if options is not None:
            kind = options_type or type(options).__name__.removesuffix("T")
            o.builtinOptionsType = getattr(self.s.BuiltinOptions, kind)
            o.builtinOptions = options
        self.operators.append(o)
        self.op_types.append((op, is_int8))

    def options(self, kind: str, **fields: Any) -> Any:
        """A <kind>OptionsT object with `fields` set."""
        obj = getattr(self.s, f"{kind}OptionsT")()
        for k, v in fields.items():
            if not hasattr(obj, k):
                raise ExportError(f"TFLite schema: {kind}Options has no field '{k}'")
            setattr(obj, k, v)
        return obj

    def to_bytes(self, description: str = "netquant") -> bytes:
        import flatbuffers

        s = self.s
        sub = s.SubGraphT()
        sub.tensors = self.tensors
        sub.inputs = list(self.inputs)
        sub.outputs = list(self.outputs)
        sub.operators = self.operators
        sub.name = "main"
        model = s.ModelT()
        model.version = 3
        model.description = description
        codes = [None] * len(self.opcodes)
        for (op, version), i in self.opcodes.items():
            oc = s.OperatorCodeT()
            oc.builtinCode = getattr(s.BuiltinOperator, op)
            oc.deprecatedBuiltinCode = min(oc.builtinCode, 127)
            oc.version = version
            codes[i] = oc
        model.operatorCodes = codes
        model.subgraphs = [sub]
        model.buffers = self.buffers
        builder = flatbuffers.Builder(1024)
        builder.Finish(model.Pack(builder), file_identifier=b"TFL3")
        return bytes(builder.Output())

    def int8_op_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for op, is_int8 in self.op_types:
            if is_int8:
                counts[op] = counts.get(op, 0) + 1
        return dict(sorted(counts.items()))
