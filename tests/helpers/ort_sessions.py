"""onnxruntime sessions the export tests run files in."""

from __future__ import annotations

from pathlib import Path

import onnx
import onnxruntime as ort


def one_thread_session(model: onnx.ModelProto | Path, optimized: bool = True,
                       saved: Path | None = None) -> ort.InferenceSession:
    """A CPU session of `model` (a proto or a file) on one intra-op thread; optimized=False: no graph optimizations
    (Q/DQ run as written); saved: where onnxruntime writes the graph it runs."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if saved is not None:
        so.optimized_model_filepath = str(saved)
    data = model.SerializeToString() if isinstance(model, onnx.ModelProto) else str(model)
    return ort.InferenceSession(data, so, providers=["CPUExecutionProvider"])
