"""Calibration data: accept the usual containers, check them against the model's inputs.

Accepted forms (N = samples along the batch dim):
- one array / tensor (single-input models): split into batches of `batch_size`;
- a dict {input name: array} of stacked samples: split the same way;
- an iterable of batches, each a dict, an array (single input) or a tuple/list (one per input).
Every batch is checked: the right inputs, each of the model's dtype and a shape matching the
model's static dims.  Errors name the input and the expected shape.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from netquant.errors import CalibrationError, DataError
from netquant.graph import Graph, Value

Batch = dict[str, torch.Tensor]


class ConstantDataWarning(UserWarning):
    """A float calibration input holds one value only (all zeros, a constant): its ranges describe no real input."""


def describe_shape(v: Value) -> str:
    if v.shape is None:
        return "[unknown]"
    return "[" + ", ".join("?" if d is None else str(d) for d in v.shape) + "]"


def _to_tensor(x: Any, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach().clone() if x.is_inference() else x.detach()  # (inference tensors: read-only elsewhere)
    if isinstance(x, np.generic):  # a numpy scalar (one sample of a 0-d input)
        x = np.asarray(x)
    if isinstance(x, np.ndarray):
        if x.dtype == object or not (np.issubdtype(x.dtype, np.number) or x.dtype == np.bool_):
            raise DataError(f"{what}: numpy arrays of dtype {x.dtype} cannot be used; give a numeric array")
        try:
            return torch.from_numpy(np.ascontiguousarray(x).reshape(x.shape))  # (ascontiguousarray makes 0-d 1-d)
        except TypeError as exc:  # numeric dtypes torch lacks (e.g. ml_dtypes' float8, int4)
            raise DataError(f"{what}: numpy arrays of dtype {x.dtype} cannot be used ({exc}); give a "
                            "float32 or integer array") from exc
    if isinstance(x, (list, tuple)) and x and all(isinstance(v, (int, float)) for v in x):
        return torch.tensor(x)
    raise DataError(f"{what}: expected a numpy array or torch tensor, got {type(x).__name__}")


def _model_inputs(graph: Graph) -> list[Value]:
    """Graph inputs that are not initializers (those are the ones data must feed)."""
    return [v for v in graph.inputs if v.name not in graph.initializers]


class CalibrationData:
    """Validated, re-iterable batches for a graph."""

    def __init__(self, graph: Graph, data: Any, batch_size: int = 16, max_batches: int | None = None) -> None:
        if batch_size < 1:
            raise DataError(f"batch_size must be >= 1, got {batch_size}")
        self.graph = graph
        self.inputs = _model_inputs(graph)
        self.batch_size = batch_size
        self.max_batches = max_batches
        self._data = data
        self._materialized: list[Batch] | None = None
        self._ranges: dict[str, tuple[float, float]] = {}  # float inputs: (min, max) over the batches checked
        self._warned = False
        if isinstance(data, (np.ndarray, torch.Tensor, Mapping)):
            self._materialized = list(self._split(self._as_batch(data, 0)))
        elif isinstance(data, (str, bytes)) or not isinstance(data, Iterable):
            raise DataError(f"calibration data must be an array, a dict of arrays or an iterable of batches; "
                            f"got {type(data).__name__}. Model inputs: {self.expected()}")
        elif isinstance(data, Sequence):
            items = data[:max_batches] if max_batches is not None else data
            self._materialized = [self._as_batch(b, i) for i, b in enumerate(items)]
        if self._materialized is not None:
            if max_batches is not None:
                self._materialized = self._materialized[:max_batches]
            if not self._materialized:
                raise CalibrationError(f"the calibration set is empty; give at least one batch for "
                                       f"{self.expected()}")
            self._warn_constant()

    def expected(self) -> str:
        return ", ".join(f"'{v.name}' {describe_shape(v)} {_dtype_name(v.dtype)}" for v in self.inputs)

    def __len__(self) -> int:
        if self._materialized is None:
            raise TypeError("length unknown for a streamed calibration set")
        return len(self._materialized)

    @property
    def num_batches(self) -> int | None:
        return len(self._materialized) if self._materialized is not None else None

    def __iter__(self) -> Iterator[Batch]:
        if self._materialized is not None:
            yield from self._materialized
            return
        n = 0
        for i, b in enumerate(self._data):
            if self.max_batches is not None and n >= self.max_batches:
                break
            yield self._as_batch(b, i)
            n += 1
        if n == 0:
            raise CalibrationError(f"the calibration set is empty; give at least one batch for {self.expected()}")
        self._warn_constant()

    def constant_inputs(self) -> dict[str, float]:
        """Float inputs whose every value seen so far is one number, with that number."""
        return {k: lo for k, (lo, hi) in self._ranges.items() if lo == hi}

    def _warn_constant(self) -> None:
        """ConstantDataWarning (once) naming each float input that held a single value in every batch."""
        if self._warned:
            return
        self._warned = True
        for name, value in self.constant_inputs().items():
            warnings.warn(ConstantDataWarning(
                f"calibration input '{name}' is constant (every value is {value:g}): the activation ranges "
                "calibrated from it describe no real input, so the quantized model will be wrong on real data; "
                "give representative samples (ignore this only if the input is constant by design)"), stacklevel=3)

    # ---- conversion and checks -------------------------------------------------------------
    def _split(self, batch: Batch) -> Iterator[Batch]:
        n = next(iter(batch.values())).shape[0] if batch and next(iter(batch.values())).dim() else 1
        sizes = {k: (v.shape[0] if v.dim() else 1) for k, v in batch.items()}
        if len(set(sizes.values())) > 1:
            raise DataError(f"calibration inputs hold different sample counts {sizes}; give the same "
                            f"number of samples for every input")
        static_batch = {v.name: v.shape[0] for v in self.inputs
                        if v.shape and isinstance(v.shape[0], int) and v.shape[0] > 0}
        step = min(static_batch.values()) if static_batch else self.batch_size
        for start in range(0, n, step):
            yield {k: v[start:start + step] for k, v in batch.items()}

    def _as_batch(self, b: Any, index: int) -> Batch:
        names = [v.name for v in self.inputs]
        where = f"calibration batch {index}"
        if isinstance(b, Mapping):
            missing = [n for n in names if n not in b]
            extra = [k for k in b if k not in names]
            if missing or extra:
                raise DataError(f"{where}: got inputs {sorted(map(str, b))}, the model takes "
                                f"{self.expected()}" + (f"; missing {missing}" if missing else "")
                                + (f"; unknown {extra}" if extra else ""))
            tensors = {n: _to_tensor(b[n], f"{where}, input '{n}'") for n in names}
        elif isinstance(b, (np.ndarray, torch.Tensor)):
            if len(names) != 1:
                raise DataError(f"{where}: got one array but the model takes {len(names)} inputs: "
                                f"{self.expected()}; give a dict or a tuple with one array per input")
            tensors = {names[0]: _to_tensor(b, f"{where}, input '{names[0]}'")}
        elif isinstance(b, (tuple, list)):
            if len(b) != len(names):
                raise DataError(f"{where}: got {len(b)} arrays but the model takes {len(names)} inputs: "
                                f"{self.expected()}")
            tensors = {n: _to_tensor(x, f"{where}, input '{n}'") for n, x in zip(names, b)}
        else:
            raise DataError(f"{where}: expected a dict, array or tuple of arrays, got {type(b).__name__}; "
                            f"the model takes {self.expected()}")
        for v in self.inputs:
            self._check(v, tensors[v.name], where)
            t = tensors[v.name]
            if t.is_floating_point() and t.numel():
                lo, hi = float(t.min()), float(t.max())
                old = self._ranges.get(v.name)
                self._ranges[v.name] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        return tensors

    def _check(self, v: Value, t: torch.Tensor, where: str) -> None:
        if v.dtype is not None and t.dtype != v.dtype:
            hint = f" (convert with .astype(np.{_dtype_name(v.dtype)}))" if v.dtype.is_floating_point else ""
            raise DataError(f"{where}: input '{v.name}' has dtype {_dtype_name(t.dtype)}, the model expects "
                            f"{_dtype_name(v.dtype)} with shape {describe_shape(v)}{hint}")
        if v.shape is None:
            return
        if t.dim() != len(v.shape):
            raise DataError(f"{where}: input '{v.name}' has shape {list(t.shape)} ({t.dim()}-d), the model "
                            f"expects {describe_shape(v)} ({len(v.shape)}-d)")
        for axis, (want, got) in enumerate(zip(v.shape, t.shape)):
            if isinstance(want, int) and want > 0 and want != got:
                raise DataError(f"{where}: input '{v.name}' has shape {list(t.shape)}, the model expects "
                                f"{describe_shape(v)} (dim {axis} must be {want})")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise DataError(f"{where}: input '{v.name}' contains NaN or Inf values; clean the data first")


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "unknown" if dtype is None else str(dtype).replace("torch.", "")
