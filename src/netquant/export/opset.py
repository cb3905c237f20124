"""Raising a model's ai.onnx opset (QDQ with per-axis scales needs opset 13) and proving it changed nothing."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import version_converter

from netquant.errors import ExportError


def ai_onnx_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 1


def upgrade_opset(model: onnx.ModelProto, target: int) -> onnx.ModelProto:
    """The model converted to ai.onnx opset `target` (unchanged when already there or newer)."""
    current = ai_onnx_opset(model)
    if current >= target:
        return model
    try:
        converted = version_converter.convert_version(model, target)
    except Exception as exc:
        raise ExportError(f"cannot upgrade model '{model.graph.name}' from opset {current} to {target} "
                          f"(needed for QuantizeLinear/DequantizeLinear with per-axis scales): {exc}") from exc
    # the converter drops graph-level names of unnamed nodes; keep the metadata the original had
    converted.ir_version = max(converted.ir_version, model.ir_version)
    return converted


def check_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict[str, np.ndarray],
                       what: str, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Run both models in onnxruntime on `feeds`; ExportError naming the output if any differs."""
    import onnxruntime as ort

    def run(model: onnx.ModelProto) -> list[np.ndarray]:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        names = {i.name for i in sess.get_inputs()}
        return sess.run(None, {k: v for k, v in feeds.items() if k in names})

    try:
        ref, got = run(before), run(after)
    except Exception as exc:
        raise ExportError(f"{what}: the converted model does not run in onnxruntime: {exc}") from exc
    for out, a, b in zip(before.graph.output, ref, got):
        if a.shape != b.shape or not np.allclose(a, b, rtol=rtol, atol=atol * max(1.0, float(np.abs(a).max(initial=0)))):
            diff = float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.shape == b.shape else "shape"
            raise ExportError(f"{what} changed output '{out.name}' (max abs diff {diff}); not exporting. "
                              "Pass opset= explicitly or export for a platform that allows the model's opset.")


def lower_ir_version(model: onnx.ModelProto) -> None:
    """Set ir_version to the lowest the model's opsets need, if the checker still accepts it.

    Engines refuse IR versions newer than they know (onnxruntime 1.31 stops at 13, while onnx 1.23's
    make_model writes 14), and a QDQ model needs no more than its opsets do.
    """
    need = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    if need >= model.ir_version:
        return
    original = model.ir_version
    model.ir_version = need
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError:
        model.ir_version = original
