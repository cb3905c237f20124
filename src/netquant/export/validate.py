"""Validation of an exported model before it is written: checker, onnxruntime load, agreement with
the executor's fake-quant run on one batch (cosine similarity of every output)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import torch

from netquant.errors import ExportError

SAMPLE_ATTRS = ("sample_inputs", "calib_sample", "example_inputs")


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def sample_feeds(qgraph: Any, sample: Any = None, *, seed: int = 0) -> dict[str, np.ndarray]:
    """One batch for validation: `sample`, else a batch the quantizer kept, else random data.

    Random data needs fully static input shapes (the first dim may be symbolic: batch 1).
    """
    graph = qgraph.graph
    names = [v.name for v in graph.inputs if v.name not in graph.initializers]
    if sample is None:
        for attr in SAMPLE_ATTRS:
            sample = getattr(qgraph, attr, None)
            if sample is not None:
                break
    if sample is not None:
        if isinstance(sample, Mapping):
            feeds = {k: _to_numpy(v) for k, v in sample.items() if k in names}
        elif isinstance(sample, (torch.Tensor, np.ndarray)):
            feeds = {names[0]: _to_numpy(sample)}
        elif isinstance(sample, Sequence):
            feeds = {n: _to_numpy(v) for n, v in zip(names, sample)}
        else:
            raise ExportError(f"validation sample must be a dict, tensor or list of tensors, got {type(sample).__name__}")
        missing = [n for n in names if n not in feeds]
        if missing:
            raise ExportError(f"validation sample lacks model inputs {missing}")
        return feeds
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in graph.inputs:
        if v.name in graph.initializers:
            continue
        shape = list(v.shape or ())
        dims = [1 if (i == 0 and not isinstance(d, int)) else d for i, d in enumerate(shape)]
        if v.shape is None or not all(isinstance(d, int) and d > 0 for d in dims):
            raise ExportError(f"cannot make a validation batch for input '{v.name}' of shape {v.shape}: "
                              "pass sample=... (one batch of real inputs) to the export")
        dtype = (torch.empty((), dtype=v.dtype).numpy().dtype if v.dtype is not None else np.float32)
        if np.issubdtype(dtype, np.floating):
            feeds[v.name] = rng.standard_normal(dims).astype(dtype)
        else:
            feeds[v.name] = rng.integers(0, 2, dims).astype(dtype)
    return feeds


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    na, nb = np.linalg.norm(a64), np.linalg.norm(b64)
    if na == 0 and nb == 0:
        return 1.0
    return float(a64 @ b64 / max(na * nb, 1e-300))


def check_model(model: onnx.ModelProto, where: str) -> None:
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ExportError(f"exported model for '{where}' fails onnx.checker: {exc}") from exc


def ort_session(path_or_bytes: Any, where: str) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    try:
        return ort.InferenceSession(path_or_bytes, so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ExportError(f"exported model for '{where}' does not load in onnxruntime: {exc}") from exc


def compare_with_executor(qgraph: Any, sess: Any, feeds: dict[str, np.ndarray], where: str,
                          min_cosine: float) -> tuple[dict[str, float], dict[str, float]]:
    """Cosine similarity and max abs diff of every output: onnxruntime vs executor fake-quant."""
    try:
        got = sess.run(None, feeds)
    except Exception as exc:
        raise ExportError(f"exported model for '{where}' fails in onnxruntime on the validation batch: {exc}") from exc
    ref = qgraph.run({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in feeds.items()}, fake_quant=True)
    cos: dict[str, float] = {}
    diff: dict[str, float] = {}
    for meta, y in zip(sess.get_outputs(), got):
        if meta.name not in ref:
            continue
        r = _to_numpy(ref[meta.name])
        if r.shape != y.shape:
            raise ExportError(f"exported model for '{where}': output '{meta.name}' has shape {y.shape} in "
                              f"onnxruntime but {r.shape} in netquant's executor")
        if not np.issubdtype(y.dtype, np.floating):
            cos[meta.name] = 1.0 if np.array_equal(r, y) else 0.0
            diff[meta.name] = float(np.abs(r.astype(np.float64) - y).max(initial=0))
            continue
        if not np.isfinite(y).all():
            raise ExportError(f"exported model for '{where}' produces NaN/Inf in output '{meta.name}'")
        cos[meta.name] = cosine(r, y)
        diff[meta.name] = float(np.abs(r.astype(np.float64) - y.astype(np.float64)).max(initial=0))
    bad = {k: v for k, v in cos.items() if v < min_cosine}
    if bad:
        raise ExportError(f"exported model for '{where}' disagrees with netquant's fake-quant executor: cosine "
                          f"{', '.join(f'{k}={v:.5f}' for k, v in bad.items())} < {min_cosine}; no file written")
    return cos, diff
