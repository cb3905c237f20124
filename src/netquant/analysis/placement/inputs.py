"""What placement measures on: the model's hash, the host, and the calibration samples it times and scores."""

from __future__ import annotations

import hashlib
import re
from typing import Any

import numpy as np
import onnx
import torch

from netquant.passes.quant_graph import QuantizedGraph


def model_hash(qgraph: QuantizedGraph) -> str:
    """sha256 of the cleaned-up FP32 graph as ONNX (what placement decisions refer to): each initializer's header and
    raw bytes in order, then the model without initializers."""
    from netquant.export.onnx_qdq import fp32_onnx_headers
    from netquant.graph.light import without_initializers

    model = fp32_onnx_headers(qgraph)  # (large float32 weights may be headers only: hashed from the graph's tensors)
    digest = hashlib.sha256()
    for t in model.graph.initializer:  # tensor by tensor, from the graph's own tensors where it has them (no copy)
        digest.update(onnx.TensorProto(name=t.name, dims=t.dims, data_type=t.data_type).SerializeToString())
        own = qgraph.graph.initializers.get(t.name)
        if isinstance(own, torch.Tensor) and own.dtype == torch.float32 and tuple(own.shape) == tuple(t.dims):
            digest.update(own.detach().contiguous().numpy().data)
        else:
            digest.update(t.raw_data if t.raw_data else t.SerializeToString(deterministic=True))
    digest.update(without_initializers(model).SerializeToString(deterministic=True))  # everything else
    return digest.hexdigest()


def host_info_dict() -> dict[str, str]:
    import onnxruntime as ort

    from netquant.platforms.targets import host_info, kernel_family

    info = host_info(ort_threads=1)
    return {"cpu": info.cpu.describe(), "kernel_family": f"{info.accumulation.value}: "
            f"{kernel_family(info.accumulation, info.cpu)}", "onnxruntime": ort.__version__}


# symbolic names of a leading axis that holds samples (a batch): only such an axis is cut to the samples placement times
_BATCH_AXIS = re.compile(r"^(n|b|bs|nb|batch|batches|batch_?size|n_?batch|num_?batch(es)?|unk__\d+|\w*_dynamic_axes_1"
                         r"|p2o\.DynamicDimension\.0)$", re.IGNORECASE)


def batch_axis(v: Any) -> bool:
    """Whether input `v`'s dim 0 is a batch axis placement may cut: a symbolic dim named like a batch ('batch',
    'N', 'batch_size', onnx's 'unk__<n>', torch's unnamed '<input>_dynamic_axes_1', paddle2onnx's first dynamic dim
    'p2o.DynamicDimension.0'), or unknown. A fixed dim, or a
    symbolic one with another name ('frames', 'seq', 'time'), keeps the calibration batch's shape: a streaming
    model's [frames, samples] input is timed with the frames it is fed."""
    if v.shape is None:
        return True  # nothing declared: as a batch (the rule before batch_axis)
    if len(v.shape) == 0:
        return False
    dim = v.shape[0]
    return dim is None or (isinstance(dim, str) and (dim == "" or bool(_BATCH_AXIS.match(dim))))


def first_samples(batch: dict[str, torch.Tensor], qgraph: QuantizedGraph, n: int) -> dict[str, torch.Tensor]:
    """The first n samples of a calibration batch along the inputs' batch axis (batch_axis); inputs without one
    (a fixed or non-batch dim 0) are taken whole, at the calibration batch's shape."""
    out = {}
    for v in qgraph.graph.inputs:
        if v.name in batch:
            x = batch[v.name]
            out[v.name] = x[:n] if batch_axis(v) and x.dim() > 0 else x
    return out


def batch1(batch: dict[str, torch.Tensor], qgraph: QuantizedGraph) -> dict[str, np.ndarray]:
    """One sample of a calibration batch, as numpy feeds for onnxruntime."""
    return {k: v.detach().cpu().numpy() for k, v in first_samples(batch, qgraph, 1).items()}

