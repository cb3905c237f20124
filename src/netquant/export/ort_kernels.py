"""Which ops onnxruntime really runs as integer kernels after its graph optimizations.

onnxruntime fuses DequantizeLinear -> Conv -> QuantizeLinear into QLinearConv (and similar) only
when its QDQ selectors match; otherwise the model runs in float with extra Q/DQ work.  We save the
optimized graph (SessionOptions.optimized_model_filepath) and count its op types.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

import onnx

from netquant.errors import ExportError
from netquant.platforms.threads import apply_to_session_options

# op types (ai.onnx and com.microsoft) that compute on 8-bit integers
INT8_KERNEL_OPS = frozenset({
    "QLinearConv", "ConvInteger", "MatMulInteger", "MatMulIntegerToFloat", "QGemm", "QLinearMatMul",
    "DynamicQuantizeMatMul", "QLinearAdd", "QLinearMul", "QLinearSigmoid", "QLinearLeakyRelu",
    "QLinearAveragePool", "QLinearGlobalAveragePool", "QLinearConcat", "QLinearSoftmax",
    "QLinearReduceMean", "QLinearWhere", "QLinearConvTranspose", "QAttention", "QOrderedMatMul",
    "NhwcQLinearConv", "QEmbedLayerNormalization", "DynamicQuantizeLSTM", "QLinearGelu",
})


def save_optimized_graph(so: Any, path: str | os.PathLike[str]) -> None:
    """Have onnxruntime write the graph it runs to `path` (SessionOptions `so`), its weights in a side file beside it:
    reading that graph back (names, op types, wiring) then parses no weights (BERT-base: 110 MB less to read)."""
    so.optimized_model_filepath = str(path)
    so.add_session_config_entry("session.optimized_model_external_initializers_file_name",
                                f"{Path(path).name}.data")
    so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")


def ort_optimized_op_types(path: str | os.PathLike[str], level: str = "all") -> Counter[str]:
    """Op-type counts of the graph onnxruntime (CPU EP) runs after optimizing the model at `path`."""
    import onnxruntime as ort

    levels = {"basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
              "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
              "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "optimized.onnx"
        so = ort.SessionOptions()
        apply_to_session_options(so)  # the thread_scope's threads, if any
        so.graph_optimization_level = levels[level]
        save_optimized_graph(so, out)
        so.log_severity_level = 3
        try:
            ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        except Exception as exc:
            raise ExportError(f"onnxruntime cannot load '{path}': {exc}") from exc
        return saved_op_types(out)


def saved_op_types(path: str | os.PathLike[str]) -> Counter[str]:
    """Op-type counts of an optimized graph onnxruntime saved (SessionOptions.optimized_model_filepath)."""
    model = onnx.load(str(path), load_external_data=False)
    return Counter(n.op_type for n in model.graph.node)


def int8_kernels_of(counts: Counter[str]) -> dict[str, int]:
    """The integer-kernel entries of an op-type count."""
    return {op: n for op, n in sorted(counts.items()) if op in INT8_KERNEL_OPS or op == "DynamicQuantizeLinear"}


def ort_int8_kernels(path: str | os.PathLike[str]) -> dict[str, int]:
    """Integer-kernel op types (QLinearConv, MatMulIntegerToFloat, QGemm, ...) onnxruntime runs, with counts.

    An empty dict means onnxruntime fused no Q/DQ pattern: the model runs in float.
    """
    return int8_kernels_of(ort_optimized_op_types(path))


def ort_runtime_qdq(counts: Counter[str]) -> int:
    """QuantizeLinear + DequantizeLinear nodes onnxruntime still executes (pure overhead on CPU)."""
    return counts.get("QuantizeLinear", 0) + counts.get("DequantizeLinear", 0)
