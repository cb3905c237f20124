"""Raising a model's ai.onnx opset (QDQ with per-axis scales needs opset 13) and proving it changed nothing."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import version_converter

from netquant.errors import ExportError
from netquant.graph.checker import check_structure
from netquant.graph.light import ort_session, tensor_bytes, without_initializers
from netquant.platforms.threads import apply_to_session_options


def ai_onnx_opset(model: onnx.ModelProto) -> int:
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx"):
            return int(imp.version)
    return 1


MIN_QDQ_OPSET = 10  # QuantizeLinear / DequantizeLinear (per-tensor); per-axis scales need 13


def check_opset_request(opset: int | None, option: str = "opset") -> None:
    """ConfigError before any work for an export opset no file can have: below MIN_QDQ_OPSET or above the newest
    the installed onnx knows (onnxruntime of the same release runs up to it)."""
    if opset is None:
        return
    newest = onnx.defs.onnx_opset_version()
    if not isinstance(opset, int) or isinstance(opset, bool) or not MIN_QDQ_OPSET <= opset <= newest:
        from netquant.errors import ConfigError

        raise ConfigError(f"{option} {opset!r} is out of range: QDQ files need opset {MIN_QDQ_OPSET} or newer (13 for "
                          f"per-channel weights) and the installed onnx {onnx.__version__} knows opsets up to "
                          f"{newest}; give one in {MIN_QDQ_OPSET}..{newest}, or leave it out (the model's, at least 13)")


BIG_INITIALIZER_BYTES = 1024  # initializers above this size travel around the converter, not through it


def upgrade_opset(model: onnx.ModelProto, target: int) -> onnx.ModelProto:
    """The model converted to ai.onnx opset `target` (unchanged when already there or newer).

    onnx's converter copies the whole model several times; the large initializers (weights, which no upward
    adapter reads: they turn attributes into new small inputs) are replaced by typed graph inputs for the
    conversion and put back afterwards, so a 240 MB model converts in a fraction of the time."""
    if ai_onnx_opset(model) >= target:
        return model
    light, big = split_big_initializers(model)
    converted = upgrade_light(light, big, target)
    converted.graph.initializer.extend(big)
    return converted


def split_big_initializers(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """(a copy of `model` without its top-level initializers above BIG_INITIALIZER_BYTES, those initializers: the
    model's own messages, not copies); the copy lists them nowhere (not even as inputs)."""
    big = [t for t in model.graph.initializer if tensor_bytes(t) > BIG_INITIALIZER_BYTES]
    names = {t.name for t in big}
    light = without_initializers(model)
    light.graph.initializer.extend(t for t in model.graph.initializer if t.name not in names)
    return light, big


def upgrade_light(light: onnx.ModelProto, big: list[onnx.TensorProto], target: int) -> onnx.ModelProto:
    """split_big_initializers' `light` converted to ai.onnx opset `target` (a new model; `light` itself when already
    there), the `big` initializers standing in as typed graph inputs during the conversion only."""
    current = ai_onnx_opset(light)
    if current >= target:
        return light
    listed = {v.name for v in light.graph.input}
    added = [t.name for t in big if t.name not in listed]  # the placeholders to drop again
    light.graph.input.extend(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                             for t in big if t.name not in listed)
    parked = _park_unknown_ops(light)
    try:
        converted = version_converter.convert_version(light, target)
    except Exception as exc:
        raise ExportError(f"cannot upgrade model '{light.graph.name}' from opset {current} to {target} "
                          f"(needed for QuantizeLinear/DequantizeLinear with per-axis scales): {exc}") from exc
    finally:
        _unpark(light, parked)
        if added:
            inputs = [v for v in light.graph.input if v.name not in set(added)]
            del light.graph.input[:]
            light.graph.input.extend(inputs)
    _unpark(converted, parked)
    if added:
        inputs = [v for v in converted.graph.input if v.name not in set(added)]
        del converted.graph.input[:]
        converted.graph.input.extend(inputs)
    # the converter drops graph-level names of unnamed nodes; keep the metadata the original had
    converted.ir_version = max(converted.ir_version, light.ir_version)
    return converted


_PARKED = "netquant.parked"  # a domain the converter passes through untouched


def _park_unknown_ops(model: onnx.ModelProto) -> bool:
    """Move default-domain nodes that onnx has no schema for (onnxruntime's contrib ops registered in the ONNX domain,
    such as SimplifiedLayerNormalization) into a placeholder domain, so onnx's converter, which asserts on unknown
    ops, adapts the rest; `_unpark` puts them back. Their semantics do not depend on the ai.onnx opset. Returns
    whether any node moved (top-level graph only)."""
    moved = False
    for node in model.graph.node:
        if node.domain in ("", "ai.onnx") and not onnx.defs.has(node.op_type):
            node.domain = _PARKED
            moved = True
    if moved:
        model.opset_import.append(onnx.helper.make_opsetid(_PARKED, 1))
    return moved


def _unpark(model: onnx.ModelProto, parked: bool) -> None:
    if not parked:
        return
    for node in model.graph.node:
        if node.domain == _PARKED:
            node.domain = ""
    kept = [o for o in model.opset_import if o.domain != _PARKED]
    del model.opset_import[:]
    model.opset_import.extend(kept)


def model_bytes(model: onnx.ModelProto) -> int:
    """The serialized size of `model`, about (to the tensor headers): everything but the initializers serialized,
    plus each initializer's data size; no copy of the weights."""
    return without_initializers(model).ByteSize() + sum(tensor_bytes(t) + len(t.name) + 16 for t in model.graph.initializer)


def check_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds: dict[str, np.ndarray],
                       what: str, rtol: float = 1e-4, atol: float = 1e-5) -> None:
    """Run both models in onnxruntime on `feeds`; ExportError naming the output if any differs."""
    import onnxruntime as ort

    def run(model: onnx.ModelProto) -> list[np.ndarray]:
        so = ort.SessionOptions()
        apply_to_session_options(so)  # the thread_scope's threads, if any
        so.log_severity_level = 3
        sess = ort_session(model, so)
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
    """Set ir_version to the lowest the model's opsets need, if the checker still accepts it (on the model's
    structure: graph.checker, no serialization of the weights).

    Engines refuse IR versions newer than they know (onnxruntime 1.31 stops at 13, while onnx 1.23's
    make_model writes 14), and a QDQ model needs no more than its opsets do.
    """
    need = onnx.helper.find_min_ir_version_for(list(model.opset_import), ignore_unknown=True)
    if need >= model.ir_version:
        return
    original = model.ir_version
    model.ir_version = need
    try:
        check_structure(model)
    except onnx.checker.ValidationError:
        model.ir_version = original
