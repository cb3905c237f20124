"""Reading an ONNX model's weights without loading it whole: the weight MatMul / Gemm and embedding Gather nodes
whose constant tensors weight-only quantization replaces, and their data read one tensor at a time from external
data (memory-mapped)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from netquant.errors import ModelError


def _initializer_index(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def consumers_of(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    """Value name -> the main graph's nodes that read it."""
    out: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            if name:
                out.setdefault(name, []).append(node)
    return out


@dataclass
class WeightMatMul:
    """A MatMul (or Gemm without transA) whose B input is a constant 2-D float initializer W [K, N]."""

    node: onnx.NodeProto
    activation: str
    weight: str
    k: int
    n: int
    transposed: bool = False  # Gemm transB=1: the initializer is W^T [N, K]
    bias: str = ""            # Gemm C input


def find_weight_matmuls(model: onnx.ModelProto, skip: Callable[[onnx.NodeProto], bool] | None = None
                        ) -> list[WeightMatMul]:
    """The MatMul / Gemm nodes of the main graph with a 2-D float32 initializer as B (K >= 16)."""
    inits = _initializer_index(model)
    found = []
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type not in ("MatMul", "Gemm") or len(node.input) < 2:
            continue
        if skip is not None and skip(node):
            continue
        tensor = inits.get(node.input[1])
        if tensor is None or len(tensor.dims) != 2 or tensor.data_type != TensorProto.FLOAT:
            continue
        transposed, bias = False, ""
        if node.op_type == "Gemm":
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 or attrs.get("beta", 1.0) != 1.0:
                continue
            transposed = bool(attrs.get("transB", 0))
            bias = node.input[2] if len(node.input) > 2 else ""
        k, n = (tensor.dims[1], tensor.dims[0]) if transposed else (tensor.dims[0], tensor.dims[1])
        if k < 16:
            continue
        found.append(WeightMatMul(node, node.input[0], node.input[1], int(k), int(n), transposed, bias))
    return found


@dataclass
class EmbeddingGather:
    """A Gather (axis 0) of rows of a constant 2-D float table [V, D] (token embeddings)."""

    node: onnx.NodeProto
    table: str
    vocab: int
    dim: int


def find_embedding_gathers(model: onnx.ModelProto) -> list[EmbeddingGather]:
    """Gather nodes of the main graph reading rows (axis 0) of a 2-D float32 initializer with D >= 16."""
    inits = _initializer_index(model)
    found = []
    for node in model.graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type != "Gather":
            continue
        tensor = inits.get(node.input[0])
        axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
        if tensor is None or len(tensor.dims) != 2 or tensor.data_type != TensorProto.FLOAT or axis != 0 \
                or tensor.dims[1] < 16:
            continue
        found.append(EmbeddingGather(node, node.input[0], int(tensor.dims[0]), int(tensor.dims[1])))
    return found


_SHARED_MAP_BYTES = 256 << 20  # data files up to this size are mapped once and kept mapped while the reader lives


class ExternalDataReader:
    """Reads initializers of a model loaded with `load_external_data=False`, one at a time (memory-mapped)."""

    def __init__(self, base_dir: Path) -> None:
        self.base_dir = base_dir
        self._maps: dict[Path, np.memmap] = {}  # one read-only map per data file, shared by its tensors

    def array(self, tensor: onnx.TensorProto) -> np.ndarray:
        if tensor.data_location != TensorProto.EXTERNAL:
            return numpy_helper.to_array(tensor)
        info = {e.key: e.value for e in tensor.external_data}
        path = self.base_dir / info["location"]
        if not path.is_file():
            raise ModelError(f"initializer '{tensor.name}': external data file '{path}' is missing; keep the model's "
                             "data file beside it")
        offset, length = int(info.get("offset", 0)), info.get("length")
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        count = int(np.prod(tensor.dims)) if tensor.dims else 1
        if length is not None and int(length) < count * np.dtype(dtype).itemsize:
            raise ModelError(f"initializer '{tensor.name}': external data in '{path}' holds {length} bytes, the tensor "
                             f"needs {count * np.dtype(dtype).itemsize}; the data file is truncated")
        whole = self._maps.get(path)
        if whole is None and 0 < path.stat().st_size <= _SHARED_MAP_BYTES:
            whole = self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        if whole is None:  # a large file: a map per tensor, released with it (mapped pages count in the RSS)
            data = np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=(count,))
            return np.asarray(data).reshape(tuple(tensor.dims))
        nbytes = count * np.dtype(dtype).itemsize
        if offset + nbytes > whole.size:
            raise ModelError(f"initializer '{tensor.name}': external data in '{path}' holds {whole.size} bytes, the "
                             f"tensor needs bytes {offset}..{offset + nbytes}; the data file is truncated")
        return np.asarray(whole[offset:offset + nbytes]).view(dtype).reshape(tuple(tensor.dims))

    def raw_bytes(self, tensor: onnx.TensorProto) -> Iterator[bytes]:
        """The tensor's little-endian bytes in chunks (without materializing big external tensors)."""
        if tensor.data_location != TensorProto.EXTERNAL:
            yield numpy_helper.to_array(tensor).tobytes()
            return
        info = {e.key: e.value for e in tensor.external_data}
        path = self.base_dir / info["location"]
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else path.stat().st_size - offset
        with open(path, "rb") as f:
            f.seek(offset)
            left = length
            while left > 0:
                chunk = f.read(min(left, 64 << 20))
                if not chunk:
                    raise ModelError(f"initializer '{tensor.name}': external data file '{path}' ends early")
                left -= len(chunk)
                yield chunk
