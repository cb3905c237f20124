"""Integer weight storage in an exported QDQ graph: constant float weight -> QuantizeLinear -> DequantizeLinear
becomes integer initializer -> DequantizeLinear.

The module exporter traces each weight quantizer as Q -> DQ on the (already fake-quantized) float weight, so the
file would carry float32 weights. `fold_weight_qdq` computes the Q node's output once, as ONNX defines it,

    q = saturate(round_half_even(w / s) + z)      (s, z broadcast per tensor, per axis or per block)

and stores q as an initializer of the Q output's integer type (int4 / uint4 packed two a byte, low nibble first;
int8 / uint8 / int16 / uint16), read by the same DequantizeLinear nodes. The DQ output is bit-identical to what the
Q -> DQ pair computes (same float32 division), and a w4 weight takes 1/8 of its float32 bytes. FP8 weights
(float8e4m3fn / float8e5m2, zero point 0) fold the same way: q = cast_fp8(clamp(w / s, -max, max)), round to nearest
even, as QuantizeLinear with saturate=1 computes it.

Blocked (per-group) Linear weights are then written in the form engines match (`reorient_blocked_weights`):
W^T [K, N] blocked along axis 0 -> MatMul, which onnxruntime fuses into its MatMulNBits kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from netquant.core.qdq_types import FP8_TYPES, INT_RANGES
from netquant.core.spec import FP8_DTYPE, FP8_MAX
from netquant.graph.ir import claim_name

_FOLDABLE = {TensorProto.INT4: np.int8, TensorProto.UINT4: np.uint8, TensorProto.INT8: np.int8,
             TensorProto.UINT8: np.uint8, TensorProto.INT16: np.int16, TensorProto.UINT16: np.uint16}


_FP8 = {elem: (FP8_DTYPE[fmt], FP8_MAX[fmt]) for fmt, elem in FP8_TYPES.items()}


@dataclass
class FoldReport:
    """What fold_weight_qdq did: folded Q nodes, float bytes dropped and integer bytes added."""

    folded: int = 0
    float_bytes: int = 0
    integer_bytes: int = 0
    reoriented: int = 0  # blocked Linear weights rewritten as W^T [K, N] (axis 0) -> MatMul


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _broadcast(param: np.ndarray, shape: tuple[int, ...], axis: int, block_size: int) -> np.ndarray:
    """A Q/DQ scale or zero point expanded to the tensor's `shape` (scalar, per axis, or blocked along axis)."""
    if param.size == 1 and block_size == 0:
        return param.reshape(())
    if block_size > 0:
        return np.repeat(param, block_size, axis=axis).take(np.arange(shape[axis]), axis=axis)
    view = [1] * len(shape)
    view[axis] = -1
    return param.reshape(view)


def quantize_linear(x: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, elem_type: int, axis: int = 1,
                    block_size: int = 0) -> np.ndarray:
    """ONNX QuantizeLinear of a float32 array: saturate(rint(x / s) + z) as int64 values of `elem_type`'s range."""
    x = x.astype(np.float32)
    if x.ndim:
        axis = axis % x.ndim
    s = _broadcast(scale.astype(np.float32), x.shape, axis, block_size)
    q = np.rint(x / s).astype(np.int64)
    if zero is not None:
        q = q + _broadcast(zero.astype(np.int64), x.shape, axis, block_size)
    lo, hi = INT_RANGES[elem_type]
    return np.clip(q, lo, hi)


def quantize_linear_fp8(x: np.ndarray, scale: np.ndarray, elem_type: int, axis: int = 1, block_size: int = 0
                        ) -> np.ndarray:
    """ONNX QuantizeLinear (saturate=1) of a float32 array to FP8 `elem_type`: the float8 values' bit patterns (uint8)."""
    dtype, fmax = _FP8[elem_type]
    x = x.astype(np.float32)
    if x.ndim:
        axis = axis % x.ndim
    y = torch.from_numpy(x / _broadcast(scale.astype(np.float32), x.shape, axis, block_size))
    return y.clamp(-fmax, fmax).to(dtype).view(torch.uint8).numpy()


def integer_tensor(name: str, values: np.ndarray, elem_type: int) -> onnx.TensorProto:
    """An initializer of integer `elem_type` holding `values` (4-bit types packed two a byte, low nibble first)."""
    if elem_type in _FP8:  # `values`: the float8 bit patterns
        return helper.make_tensor(name, elem_type, list(values.shape), values.astype(np.uint8).tobytes(), raw=True)
    if elem_type in (TensorProto.INT4, TensorProto.UINT4):
        nib = (values.reshape(-1).astype(np.int64) & 0x0F).astype(np.uint8)
        if nib.size % 2:
            nib = np.append(nib, np.uint8(0))
        raw = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8).tobytes()
        return helper.make_tensor(name, elem_type, list(values.shape), raw, raw=True)
    return numpy_helper.from_array(values.astype(_FOLDABLE[elem_type]), name)


def _constant(name: str, inits: dict[str, onnx.TensorProto]) -> np.ndarray | None:
    t = inits.get(name)
    return None if t is None else numpy_helper.to_array(t)


def fold_weight_qdq(model: onnx.ModelProto) -> FoldReport:
    """Fold, in place, every QuantizeLinear of the main graph whose input, scale and zero point are initializers and
    whose output feeds only DequantizeLinear nodes (with the same scale, zero point, axis and block_size) into an
    integer initializer read by those DQ nodes; float initializers nobody reads any more are dropped."""
    graph = model.graph
    report = FoldReport()
    inits = {t.name: t for t in graph.initializer}
    consumers = _consumers(graph)
    outputs = {o.name for o in graph.output}
    taken = set(inits) | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    dropped_q: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.op_type != "QuantizeLinear" or node.domain not in ("", "ai.onnx") or node.output[0] in outputs:
            continue
        if len(node.input) < 2 or node.input[0] not in inits or node.input[1] not in inits:
            continue
        x_t = inits[node.input[0]]
        if x_t.data_type != TensorProto.FLOAT:
            continue
        attrs = _attrs(node)
        zp_name = node.input[2] if len(node.input) > 2 else ""
        if zp_name and zp_name not in inits:
            continue
        elem_type = inits[zp_name].data_type if zp_name else int(attrs.get("output_dtype", 0) or TensorProto.UINT8)
        if elem_type not in _FOLDABLE and elem_type not in _FP8:
            continue
        users = consumers.get(node.output[0], [])
        axis, block = int(attrs.get("axis", 1)), int(attrs.get("block_size", 0))  # type: ignore[call-overload]
        if not users or not all(_same_dq(u, node, axis, block) for u in users):
            continue
        x = numpy_helper.to_array(x_t)
        zero = _constant(zp_name, inits) if zp_name else None
        scale = numpy_helper.to_array(inits[node.input[1]])
        if elem_type in _FP8:
            if (zero is not None and np.any(zero.astype(np.float32) != 0)) or not attrs.get("saturate", 1):
                continue
            q = quantize_linear_fp8(x, scale, elem_type, axis, block)
        else:
            q = quantize_linear(x, scale, zero, elem_type, axis, block)
        q_t = integer_tensor(claim_name(f"{node.input[0]}_quantized", taken), q, elem_type)
        graph.initializer.append(q_t)
        inits[q_t.name] = q_t
        for user in users:
            user.input[0] = q_t.name
        dropped_q.append(node)
        report.folded += 1
        report.integer_bytes += len(q_t.raw_data)
        consumers[node.input[0]].remove(node)
        if not consumers[node.input[0]] and node.input[0] not in outputs:
            report.float_bytes += int(x.nbytes)
            graph.initializer.remove(x_t)
            del inits[node.input[0]]
    for node in dropped_q:
        graph.node.remove(node)
    report.reoriented = reorient_blocked_weights(model)
    return report


def _transposed(name: str, inits: dict[str, onnx.TensorProto], graph: onnx.GraphProto, taken: set[str]) -> str:
    """A new initializer holding the 2-D initializer `name` transposed (integer or float)."""
    t = inits[name]
    values = numpy_helper.to_array(t)
    if t.data_type in _FOLDABLE:
        new = integer_tensor(claim_name(f"{name}_t", taken), np.ascontiguousarray(values.astype(np.int64).T), t.data_type)
    else:
        new = numpy_helper.from_array(np.ascontiguousarray(values.T), claim_name(f"{name}_t", taken))
    graph.initializer.append(new)
    inits[new.name] = new
    return new.name


def reorient_blocked_weights(model: onnx.ModelProto) -> int:
    """Blocked integer weights of Linear layers in the form engines match: the exporter's W [N, K] with blocks along
    axis 1, read through Transpose(perm=[1, 0]) -> MatMul or by Gemm(transB=1), becomes W^T [K, N] with blocks along
    axis 0 -> MatMul (+ Add for a Gemm bias); the same values, so the same outputs. onnxruntime fuses this
    DequantizeLinear -> MatMul into its MatMulNBits kernel (the other forms dequantize the whole weight every run).
    Returns how many weights were rewritten."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers = _consumers(graph)
    outputs = {o.name for o in graph.output}
    taken = set(inits) | {o for n in graph.node for o in n.output} | {i.name for i in graph.input}
    done = 0
    for dq in list(graph.node):
        if dq.op_type != "DequantizeLinear" or dq.domain not in ("", "ai.onnx") or dq.output[0] in outputs:
            continue
        attrs = _attrs(dq)
        q_t = inits.get(dq.input[0])
        params = [n for n in dq.input[1:] if n]
        if q_t is None or q_t.data_type not in _FOLDABLE or len(q_t.dims) != 2 or not attrs.get("block_size") \
                or int(attrs.get("axis", 1)) % 2 != 1 or not all(n in inits for n in params):  # type: ignore[call-overload]
            continue
        users = consumers.get(dq.output[0], [])
        if len(users) != 1:
            continue
        user = users[0]
        if user.op_type == "Transpose" and [list(a.ints) for a in user.attribute if a.name == "perm"] in ([[1, 0]], []):
            nxt = consumers.get(user.output[0], [])
            if len(nxt) != 1 or nxt[0].op_type != "MatMul" or list(nxt[0].input[1:]) != [user.output[0]] \
                    or user.output[0] in outputs:
                continue
            nxt[0].input[1] = dq.output[0]
            graph.node.remove(user)
        elif user.op_type == "Gemm" and list(user.input[1:2]) == [dq.output[0]]:
            g = _attrs(user)
            if not g.get("transB", 0) or g.get("transA", 0) or g.get("alpha", 1.0) != 1.0 or g.get("beta", 1.0) != 1.0:
                continue
            index = list(graph.node).index(user)
            bias = user.input[2] if len(user.input) > 2 else ""
            out = user.output[0]
            mm_out = claim_name(f"{out}_matmul", taken) if bias else out
            new = [helper.make_node("MatMul", [user.input[0], dq.output[0]], [mm_out], name=user.name)]
            if bias:
                new.append(helper.make_node("Add", [mm_out, bias], [out], name=claim_name(f"{user.name}_bias", taken)))
            graph.node.remove(user)
            for offset, n in enumerate(new):
                graph.node.insert(index + offset, n)
        else:
            continue
        stale = {dq.output[0], user.output[0]}  # their recorded shapes were [N, K]
        kept_info = [v for v in graph.value_info if v.name not in stale]
        del graph.value_info[:]
        graph.value_info.extend(kept_info)
        new_inputs = [_transposed(n, inits, graph, taken) if n else "" for n in dq.input]
        old_inputs = list(dq.input)
        dq.input[:] = new_inputs
        kept = [a for a in dq.attribute if a.name != "axis"]
        del dq.attribute[:]
        dq.attribute.extend([*kept, helper.make_attribute("axis", 0)])
        for name in old_inputs:
            if name and not any(name in n.input for n in graph.node) and name not in outputs and name in inits:
                graph.initializer.remove(inits.pop(name))
        done += 1
    return done


def _same_dq(user: onnx.NodeProto, q: onnx.NodeProto, axis: int, block: int) -> bool:
    if user.op_type != "DequantizeLinear" or user.domain not in ("", "ai.onnx") or user.input[0] != q.output[0]:
        return False
    if [n for n in user.input[1:] if n] != [n for n in q.input[1:3] if n]:
        return False
    attrs = _attrs(user)
    return int(attrs.get("axis", 1)) == axis and int(attrs.get("block_size", 0)) == block  # type: ignore[call-overload]


__all__ = ["FoldReport", "fold_weight_qdq", "integer_tensor", "quantize_linear", "quantize_linear_fp8",
           "reorient_blocked_weights"]


def _consumers(graph: onnx.GraphProto) -> dict[str, list[onnx.NodeProto]]:
    """Value name -> the nodes of `graph` that read it."""
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    return consumers

