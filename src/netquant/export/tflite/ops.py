"""One converter per ONNX op family: int8 TFLite ops where netquant quantizes the op, float ones elsewhere.

TFLite's int8 kernels (the TFLite int8 quantization spec) fix some output params: SOFTMAX and LOGISTIC write
scale 1/256, zero point -128, TANH 1/128, 0; pooling, reshapes, transposes, slices and concatenation keep
their input's params. Where netquant's params differ, the op writes TFLite's params and a requantizing
QUANTIZE brings the tensor to netquant's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from netquant.core.ops import quantize
from netquant.errors import ExportError
from netquant.export.slots import params_of
from netquant.export.tflite import layout
from netquant.export.tflite.convert import Converter, OpConverter, Stored, _check_int8
from netquant.export.tflite.writer import Quant, Tensor
from netquant.graph import Node

SOFTMAX_QUANT = Quant((1.0 / 256.0,), (-128,))  # TFLite int8 Softmax / Logistic output
TANH_QUANT = Quant((1.0 / 128.0,), (0,))  # TFLite int8 Tanh output


# ---------------------------------------------------------------------------------------------- helpers
def _ints(cv: Converter, name: str) -> list[int]:
    return [int(v) for v in np.asarray(cv.const(name)).reshape(-1)]


def _requant_output(cv: Converter, node: Node, produced: Stored, j: int = 0) -> None:
    """Define node output j from an int8 tensor whose params an op fixed; requantize to netquant's params."""
    want = cv.out_quant(node, j)
    if want is not None and produced.tensor.quant != want:
        t = cv.w.add_tensor(f"{node.outputs[j]}_rq", produced.tensor.shape, np.int8, want)
        cv.w.add_op("QUANTIZE", [produced.tensor], [t])
        produced = Stored(t, produced.cl)
    cv.define(node.outputs[j], produced)


def _same_params_op(cv: Converter, node: Node, op: str, x: Stored, extra: Sequence[Tensor | None],
                    out_shape: tuple[int, ...], out_cl: bool, options: Any = None, int8: bool = True) -> None:
    """An op whose int8 kernel keeps its input's params (pooling, reshape, transpose, slice)."""
    if int8:
        out = cv.w.add_tensor(node.outputs[0], layout.stored_shape(out_shape, out_cl), np.int8, x.tensor.quant)
        cv.w.add_op(op, [x.tensor, *extra], [out], options)
        _requant_output(cv, node, Stored(out, out_cl and len(out_shape) == 4))
        return
    out_v = cv.float_output(node, out_cl, onnx_shape=out_shape)
    cv.w.add_op(op, [x.tensor, *extra], [out_v.tensor], options)
    cv.finish_float(node, out_v)


def _x_int8(cv: Converter, node: Node) -> bool:
    """int8 mode for a one-activation op, else note it as float."""
    int8 = cv.int8_mode(node)
    if not int8:
        cv.note_float(node)
    return int8


# ---------------------------------------------------------------------------------------------- conv
ACTIVATIONS = {"Relu": "RELU", "Clip": None}


def _clip_bounds(cv: Converter, node: Node) -> tuple[float, float]:
    lo, hi = node.attrs.get("min", -math.inf), node.attrs.get("max", math.inf)
    if len(node.inputs) > 1 and node.inputs[1]:
        lo = float(np.asarray(cv.const(node.inputs[1])).reshape(()))
    if len(node.inputs) > 2 and node.inputs[2]:
        hi = float(np.asarray(cv.const(node.inputs[2])).reshape(()))
    return float(lo), float(hi)


def _fused_activation(cv: Converter, node: Node, act: Node) -> str | None:
    """TFLite fused activation name for Relu / Clip node `act`, or None when it has no fused form."""
    if act.op_type == "Relu":
        return "RELU"
    if act.op_type == "Clip":
        try:
            lo, hi = _clip_bounds(cv, act)
        except KeyError:
            return None
        return {(0.0, 6.0): "RELU6", (-1.0, 1.0): "RELU_N1_TO_1", (0.0, math.inf): "RELU"}.get((lo, hi))
    return None


def _fusable_tail(cv: Converter, node: Node) -> tuple[Node, str] | None:
    """The Relu / Clip that alone consumes node's output and can be fused into it, with its TFLite name."""
    out = node.outputs[0]
    cons = cv.consumers.get(out, [])
    if len(cons) != 1 or cv.graph.is_graph_output(out) or cons[0].op_type not in ACTIVATIONS:
        return None
    act = cons[0]
    name = _fused_activation(cv, act, act)
    if name is None:
        return None
    q_head, q_tail = cv.out_quant(node), cv.out_quant(act)
    if (q_head is None) != (q_tail is None) or (q_head is not None and q_head != q_tail):
        return None
    return act, name


def _padding(cv: Converter, node: Node, x: Stored, in_hw: Sequence[int], kernel: Sequence[int],
             strides: Sequence[int], dilations: Sequence[int], pad_value: float | None) -> tuple[Stored, str]:
    """SAME / VALID for the node's ONNX padding, with an explicit PAD (PADV2 with `pad_value` for max pooling)
    when it is neither."""
    auto = node.attrs.get("auto_pad", "NOTSET")
    if isinstance(auto, bytes):
        auto = auto.decode()
    same = []
    for n, k, s, d in zip(in_hw, kernel, strides, dilations):
        out = -(-n // s)
        total = max((out - 1) * s + (k - 1) * d + 1 - n, 0)
        same += [total // 2, total - total // 2]
    if auto in ("SAME_UPPER",):
        return x, "SAME"
    if auto == "VALID":
        return x, "VALID"
    pads = list(node.attrs.get("pads", [0] * 4))
    begin, end = pads[:2], pads[2:]
    if begin == [same[0], same[2]] and end == [same[1], same[3]]:
        return x, "SAME"
    if not any(pads):
        return x, "VALID"
    if auto == "SAME_LOWER":
        raise ExportError(f"TFLite export: {node.op_type} '{node.name}' uses auto_pad SAME_LOWER")
    paddings = np.array([[0, 0], [begin[0], end[0]], [begin[1], end[1]], [0, 0]], dtype=np.int32)
    shape = list(x.tensor.shape)
    shape[1] += begin[0] + end[0]
    shape[2] += begin[1] + end[1]
    padded = cv.w.add_tensor(f"{node.name}_padded", shape, x.tensor.dtype, x.tensor.quant)
    pad_t = cv.constant(f"{node.name}_paddings", paddings)
    if pad_value is None:
        cv.w.add_op("PAD", [x.tensor, pad_t], [padded])
    else:
        if x.is_int8:
            fill = np.array(-128, dtype=np.int8)
            fill_t = cv.constant(f"{node.name}_pad_value", fill, x.tensor.quant)
        else:
            fill_t = cv.constant(f"{node.name}_pad_value", np.array(pad_value, dtype=np.float32))
        cv.w.add_op("PADV2", [x.tensor, pad_t, fill_t], [padded])
    return Stored(padded, True), "VALID"


def _weight_codes(cv: Converter, node: Node, i: int) -> tuple[np.ndarray, np.ndarray]:
    """int8 codes of weight input i with its per-channel scales (zero point 0, codes in [-127, 127])."""
    cfg = cv.in_cfg(node, i)
    assert cfg is not None
    scale, zp, spec = params_of(cfg)
    _check_int8(spec, f"weight '{node.inputs[i]}' of {node.op_type} '{node.name}'", per_tensor=False)
    if bool((zp != 0).any()) or not spec.symmetric:
        raise ExportError(f"TFLite export: weight '{node.inputs[i]}' of '{node.name}' has non-zero zero points; "
                          "TFLite's int8 kernels need symmetric weights (platform 'tflite_int8')")
    from netquant.core.int_kernels import quantize_limited

    w = torch.from_numpy(np.asarray(cv.const(node.inputs[i]), dtype=np.float32))
    codes = quantize_limited(w, scale, zp, spec, cfg.effective_pair_limit).numpy().astype(np.int8)
    if int(codes.min(initial=0)) < -127:
        codes = np.maximum(codes, -127).astype(np.int8)  # TFLite's weight range is [-127, 127]
    return codes, scale.reshape(-1).numpy().astype(np.float32)


def _bias(cv: Converter, node: Node, i: int | None, n: int, in_scale: float | None,
          w_scale: np.ndarray | None) -> Tensor | None:
    """Bias input i: int32 with scale in_scale * w_scale (int8), float32 otherwise; None without bias."""
    if i is None or i >= len(node.inputs) or not node.inputs[i]:
        data = np.zeros(n, dtype=np.float32)  # LiteRT's float CONV_2D wants a bias tensor too
    else:
        data = np.asarray(cv.const(node.inputs[i]), dtype=np.float32).reshape(-1)
        if data.size == 1 and n > 1:
            data = np.full(n, float(data[0]), dtype=np.float32)
    if in_scale is None or w_scale is None:
        return cv.constant(f"{node.name}_bias", data.astype(np.float32))
    scale = (np.float64(in_scale) * w_scale.astype(np.float64)).astype(np.float32)
    scale = np.broadcast_to(scale, (n,)).copy()
    cfg = cv.in_cfg(node, i) if i is not None and i < len(node.inputs) and node.inputs[i] else None
    if cfg is not None:
        b_scale, b_zp, b_spec = params_of(cfg)
        codes = quantize(torch.from_numpy(data), b_scale.reshape(-1) if b_scale.numel() > 1 else b_scale,
                         b_zp.reshape(-1) if b_zp.numel() > 1 else b_zp, b_spec).numpy()
        bs = np.broadcast_to(b_scale.reshape(-1).numpy().astype(np.float32), (n,))
        if not np.allclose(bs, scale, rtol=1e-6, atol=0):
            codes = np.clip(np.round(data.astype(np.float64) / scale), -2**31, 2**31 - 1)
    else:
        codes = np.clip(np.round(data.astype(np.float64) / scale), -2**31, 2**31 - 1)
    return cv.constant(f"{node.name}_bias", codes.astype(np.int32), Quant(tuple(map(float, scale)),
                                                                         (0,) * n, 0))


def conv(cv: Converter, node: Node) -> None:
    """Conv -> CONV_2D (weights OHWI) or DEPTHWISE_CONV_2D (weights 1HWO), Relu / Clip fused."""
    w_name = node.inputs[1]
    if not cv.is_const(w_name):
        raise ExportError(f"TFLite export: Conv '{node.name}' has a non-constant weight")
    weight = np.asarray(cv.const(w_name), dtype=np.float32)
    if weight.ndim != 4:
        raise ExportError(f"TFLite export: Conv '{node.name}' is {weight.ndim - 2}-D; only 2-D convolutions")
    cout, cin_g, kh, kw = weight.shape
    in_shape = cv.shape(node.inputs[0])
    group = int(node.attrs.get("group", 1))
    depthwise = group > 1 and cin_g == 1 and group == in_shape[1]
    if group > 1 and not depthwise:
        raise ExportError(f"TFLite export: grouped Conv '{node.name}' (group {group}, not depthwise) has no "
                          "TFLite kernel")
    tail = _fusable_tail(cv, node)
    last = tail[0] if tail is not None else node
    int8 = cv.int8_mode(node, [0]) and cv.in_cfg(node, 1) is not None and \
        (tail is None or cv.out_cfg(last) is not None)
    if not int8:
        cv.note_float(node)
    x = cv.input_for(node, 0, cl=True, int8=int8)
    strides = list(node.attrs.get("strides", [1, 1]))
    dil = list(node.attrs.get("dilations", [1, 1]))
    x, padding = _padding(cv, node, x, in_shape[2:], (kh, kw), strides, dil, None)
    if int8:
        codes, w_scale = _weight_codes(cv, node, 1)
        assert x.tensor.quant is not None
        in_scale = x.tensor.quant.scale[0]
    else:
        codes, w_scale, in_scale = weight, None, None
    if depthwise:
        data = codes.transpose(1, 2, 3, 0)  # (1, kh, kw, Cout)
        axis = 3
    else:
        data = codes.transpose(0, 2, 3, 1)  # (Cout, kh, kw, Cin)
        axis = 0
    wq = Quant(tuple(map(float, w_scale)), (0,) * cout, axis) if w_scale is not None else None
    w_t = cv.constant(w_name, np.ascontiguousarray(data), wq)
    b_t = _bias(cv, node, 2 if len(node.inputs) > 2 else None, cout, in_scale, w_scale)
    act = tail[1] if tail is not None else "NONE"
    act_code = getattr(cv.w.s.ActivationFunctionType, act)
    pad_code = getattr(cv.w.s.Padding, padding)
    out_shape = cv.shape(last.outputs[0])
    if depthwise:
        opts = cv.w.options("DepthwiseConv2D", padding=pad_code, strideH=strides[0], strideW=strides[1],
                            dilationHFactor=dil[0], dilationWFactor=dil[1], depthMultiplier=cout // group,
                            fusedActivationFunction=act_code)
        op = "DEPTHWISE_CONV_2D"
    else:
        opts = cv.w.options("Conv2D", padding=pad_code, strideH=strides[0], strideW=strides[1],
                            dilationHFactor=dil[0], dilationWFactor=dil[1], fusedActivationFunction=act_code)
        op = "CONV_2D"
    if tail is not None:
        cv.skip.add(tail[0].name)
        cv.alias[node.outputs[0]] = last.outputs[0]
    if int8:
        out = cv.output(last, out_shape, cl=True)
        cv.w.add_op(op, [x.tensor, w_t, b_t], [out.tensor], opts)
    else:
        out = cv.float_output(last, cl=True, onnx_shape=out_shape)
        cv.w.add_op(op, [x.tensor, w_t, b_t], [out.tensor], opts)
        cv.finish_float(last, out)


def _fc_weight(cv: Converter, node: Node, i: int, transpose: bool, int8: bool) -> tuple[Tensor, np.ndarray | None]:
    """A 2-D weight as FULLY_CONNECTED's (N, K): int8 per-channel along N, or float."""
    if int8:
        codes, scale = _weight_codes(cv, node, i)
        data = codes.T if transpose else codes
        n = data.shape[0]
        s = np.broadcast_to(scale, (n,)) if scale.size == 1 else scale
        q = Quant(tuple(map(float, s)), (0,) * n, 0) if scale.size > 1 else Quant((float(scale[0]),), (0,))
        return cv.constant(node.inputs[i], np.ascontiguousarray(data), q), scale
    w = np.asarray(cv.const(node.inputs[i]), dtype=np.float32)
    return cv.constant(node.inputs[i], np.ascontiguousarray(w.T if transpose else w)), None


def _fully_connected(cv: Converter, node: Node, w_index: int, transpose: bool, bias_index: int | None) -> None:
    int8 = cv.int8_mode(node, [0]) and cv.in_cfg(node, w_index) is not None
    if not int8:
        cv.note_float(node)
    x = cv.input_for(node, 0, cl=False, int8=int8)
    w_t, w_scale = _fc_weight(cv, node, w_index, transpose, int8)
    n = w_t.shape[0]
    in_scale = x.tensor.quant.scale[0] if int8 and x.tensor.quant is not None else None
    b_t = _bias(cv, node, bias_index, n, in_scale, w_scale)
    opts = cv.w.options("FullyConnected", keepNumDims=True)
    if int8:
        out = cv.output(node)
        cv.w.add_op("FULLY_CONNECTED", [x.tensor, w_t, b_t], [out.tensor], opts)
    else:
        out = cv.float_output(node)
        cv.w.add_op("FULLY_CONNECTED", [x.tensor, w_t, b_t], [out.tensor], opts)
        cv.finish_float(node, out)


def matmul(cv: Converter, node: Node) -> None:
    """MatMul: constant 2-D B -> FULLY_CONNECTED (weights (N, K)); two activations -> BATCH_MATMUL."""
    b = node.inputs[1]
    if cv.is_const(b) and np.asarray(cv.const(b)).ndim == 2:
        _fully_connected(cv, node, 1, transpose=True, bias_index=None)
        return
    int8 = cv.int8_mode(node) and cv.out_cfg(node) is not None
    if not int8:
        cv.note_float(node)
    x = cv.input_for(node, 0, cl=False, int8=int8)
    y = cv.input_for(node, 1, cl=False, int8=int8)
    opts = cv.w.options("BatchMatMul", adjX=False, adjY=False)
    if int8:
        out = cv.output(node)
        cv.w.add_op("BATCH_MATMUL", [x.tensor, y.tensor], [out.tensor], opts)
    else:
        out = cv.float_output(node)
        cv.w.add_op("BATCH_MATMUL", [x.tensor, y.tensor], [out.tensor], opts)
        cv.finish_float(node, out)


def gemm(cv: Converter, node: Node) -> None:
    """Gemm (alpha = beta = 1, transA = 0, constant B) -> FULLY_CONNECTED with bias."""
    if int(node.attrs.get("transA", 0)) or float(node.attrs.get("alpha", 1.0)) != 1.0 or \
            float(node.attrs.get("beta", 1.0)) != 1.0 or not cv.is_const(node.inputs[1]):
        raise ExportError(f"TFLite export: Gemm '{node.name}' needs transA=0, alpha=beta=1 and a constant B")
    bias = 2 if len(node.inputs) > 2 and node.inputs[2] else None
    if bias is not None and np.asarray(cv.const(node.inputs[2])).ndim > 1:
        raise ExportError(f"TFLite export: Gemm '{node.name}' has a 2-D C; only a per-column bias converts")
    _fully_connected(cv, node, 1, transpose=not int(node.attrs.get("transB", 0)), bias_index=bias)


# ---------------------------------------------------------------------------------------------- pooling
def pool(cv: Converter, node: Node) -> None:
    """MaxPool / AveragePool -> MAX_POOL_2D / AVERAGE_POOL_2D (int8 output keeps the input's params)."""
    kernel = list(node.attrs["kernel_shape"])
    if len(kernel) != 2:
        raise ExportError(f"TFLite export: {node.op_type} '{node.name}' is not 2-D")
    strides = list(node.attrs.get("strides", [1, 1]))
    dil = list(node.attrs.get("dilations", [1, 1]))
    if dil != [1, 1]:
        raise ExportError(f"TFLite export: {node.op_type} '{node.name}' has dilations {dil}")
    is_max = node.op_type == "MaxPool"
    int8 = _x_int8(cv, node)
    x = cv.input_for(node, 0, cl=True, int8=int8)
    in_shape = cv.shape(node.inputs[0])
    out_shape = cv.shape(node.outputs[0])
    x, padding = _padding(cv, node, x, in_shape[2:], kernel, strides, [1, 1], -math.inf if is_max else None)
    if not is_max and padding == "VALID" and any(node.attrs.get("pads", [0])) and \
            not int(node.attrs.get("count_include_pad", 0)):
        raise ExportError(f"TFLite export: AveragePool '{node.name}' excludes explicit non-SAME padding from its "
                          "averages; TFLite cannot")
    if not is_max and padding == "SAME" and int(node.attrs.get("count_include_pad", 0)) and \
            any(node.attrs.get("pads", [0])):
        raise ExportError(f"TFLite export: AveragePool '{node.name}' counts padding (count_include_pad=1)")
    opts = cv.w.options("Pool2D", padding=getattr(cv.w.s.Padding, padding), strideH=strides[0],
                        strideW=strides[1], filterHeight=kernel[0], filterWidth=kernel[1])
    stored = tuple(x.tensor.shape)
    expect_h = (stored[1] - kernel[0]) // strides[0] + 1 if padding == "VALID" else -(-stored[1] // strides[0])
    if int(node.attrs.get("ceil_mode", 0)) and expect_h != out_shape[2]:
        raise ExportError(f"TFLite export: {node.op_type} '{node.name}' uses ceil_mode")
    _same_params_op(cv, node, "MAX_POOL_2D" if is_max else "AVERAGE_POOL_2D", x, [], out_shape, True, opts, int8)


def global_pool(cv: Converter, node: Node) -> None:
    """GlobalAveragePool / GlobalMaxPool -> MEAN / REDUCE_MAX over H, W (keep dims)."""
    int8 = _x_int8(cv, node)
    x = cv.input_for(node, 0, cl=True, int8=int8)
    axes = cv.constant(f"{node.name}_axes", np.array([1, 2], dtype=np.int32))
    op = "MEAN" if node.op_type == "GlobalAveragePool" else "REDUCE_MAX"
    opts = cv.w.options("Reducer", keepDims=True)
    if op == "REDUCE_MAX":
        _same_params_op(cv, node, op, x, [axes], cv.shape(node.outputs[0]), True, opts, int8)
        return
    if int8:
        out = cv.output(node, cl=True)
        cv.w.add_op(op, [x.tensor, axes], [out.tensor], opts)
    else:
        out = cv.float_output(node, cl=True)
        cv.w.add_op(op, [x.tensor, axes], [out.tensor], opts)
        cv.finish_float(node, out)


def reduce_mean(cv: Converter, node: Node) -> None:
    """ReduceMean -> MEAN over the stored axes."""
    in_shape = cv.shape(node.inputs[0])
    rank = len(in_shape)
    if "axes" in node.attrs:
        axes = list(node.attrs["axes"])
    elif len(node.inputs) > 1 and node.inputs[1]:
        axes = _ints(cv, node.inputs[1])
    else:
        axes = list(range(rank))
    keep = bool(int(node.attrs.get("keepdims", 1)))
    int8 = _x_int8(cv, node)
    cur = cv.values.get(cv.alias.get(node.inputs[0], node.inputs[0]))
    cl = bool(cur is not None and cur.cl and keep)
    x = cv.input_for(node, 0, cl=cl if rank == 4 else None, int8=int8)
    stored_axes = sorted(layout.stored_axis(a, rank, x.cl) for a in axes)
    axes_t = cv.constant(f"{node.name}_axes", np.array(stored_axes, dtype=np.int32))
    opts = cv.w.options("Reducer", keepDims=keep)
    if int8:
        out = cv.output(node, cl=x.cl)
        cv.w.add_op("MEAN", [x.tensor, axes_t], [out.tensor], opts)
    else:
        out = cv.float_output(node, cl=x.cl)
        cv.w.add_op("MEAN", [x.tensor, axes_t], [out.tensor], opts)
        cv.finish_float(node, out)


# ---------------------------------------------------------------------------------------------- element-wise
BINARY = {"Add": "ADD", "Sub": "SUB", "Mul": "MUL", "Div": "DIV", "Max": "MAXIMUM", "Min": "MINIMUM",
          "Pow": "POW"}
INT8_BINARY = frozenset({"Add", "Sub", "Mul"})


def _operand(cv: Converter, node: Node, i: int, rank: int, cl: bool, int8: bool) -> Stored:
    """Input i broadcast-ready for a rank-`rank` op stored channels-last or not."""
    name = node.inputs[i]
    shape = cv.shape(name)
    if cv.is_const(name):
        data = np.asarray(cv.const(name), dtype=np.float32)
        if cl and data.ndim > 1 or (cl and data.ndim == 1 and data.size > 1):
            data = data.reshape(layout.broadcast_rank(data.shape, rank))
        x = layout.to_stored(data, cl and data.ndim == 4)
        if int8:
            q = cv.in_quant(node, i)
            if q is None:
                lo, hi = min(float(x.min(initial=0)), 0.0), max(float(x.max(initial=0)), 0.0)
                s = max((hi - lo) / 255.0, 1e-8)
                q = Quant((s,), (int(np.clip(-128 - round(lo / s), -128, 127)),))
            codes = np.clip(np.round(x.astype(np.float64) / q.scale[0]) + q.zero_point[0], -128, 127)
            return Stored(cv.constant(f"{name}_q", codes.astype(np.int8), q), cl and data.ndim == 4)
        q = cv.in_quant(node, i)
        if q is not None:  # netquant fake-quantizes the constant
            x = ((np.clip(np.round(x.astype(np.float64) / q.scale[0]) + q.zero_point[0], -128, 127)
                  - q.zero_point[0]) * q.scale[0]).astype(np.float32)
        return Stored(cv.constant(name, np.ascontiguousarray(x)), cl and data.ndim == 4)
    if len(shape) == 4 or not cl:
        return cv.input_for(node, i, cl=cl if len(shape) == 4 else None, int8=int8)
    v = cv.input_for(node, i, cl=False, int8=int8)
    if int(np.prod(shape)) == 1 or len(shape) == 0:
        return v
    full = layout.broadcast_rank(shape, 4)
    r = cv.w.add_tensor(f"{name}_4d", full, v.tensor.dtype, v.tensor.quant)
    cv.w.add_op("RESHAPE", [v.tensor, cv.constant(f"{name}_4d_shape", np.array(full, np.int32))], [r])
    t = cv.w.add_tensor(f"{name}_4d_nhwc", layout.stored_shape(full, True), v.tensor.dtype, v.tensor.quant)
    cv.w.add_op("TRANSPOSE", [r, cv.constant(f"{name}_perm", np.array(layout.TO_NHWC, np.int32))], [t])
    return Stored(t, True)


def _wants_cl(cv: Converter, node: Node, rank: int) -> bool:
    if rank != 4:
        return False
    for i in node.inputs:
        v = cv.values.get(cv.alias.get(i, i))
        if v is not None and v.cl:
            return True
    return False


def binary(cv: Converter, node: Node) -> None:
    """Add / Sub / Mul (int8 when quantized), Div / Pow / Max / Min (float) with broadcasting."""
    if node.op_type == "Mul" and node.name in cv.hard_swish:
        hard_swish(cv, node, cv.hard_swish[node.name])
        return
    out_shape = cv.shape(node.outputs[0])
    rank = len(out_shape)
    cl = _wants_cl(cv, node, rank)
    int8 = node.op_type in INT8_BINARY and cv.int8_mode(node)
    if not int8:
        cv.note_float(node)
    a = _operand(cv, node, 0, rank, cl, int8)
    op = BINARY[node.op_type]
    if node.op_type == "Pow" and cv.is_const(node.inputs[1]) and \
            np.asarray(cv.const(node.inputs[1])).size == 1 and float(np.asarray(cv.const(node.inputs[1]))) == 2.0:
        b, op = a, "MUL"  # x^2 as x * x
    elif node.op_type == "Div" and cv.is_const(node.inputs[1]) and cv.in_cfg(node, 1) is None:
        recip = (1.0 / np.asarray(cv.const(node.inputs[1]), dtype=np.float64)).astype(np.float32)
        data = recip.reshape(layout.broadcast_rank(recip.shape, rank)) if cl and recip.size > 1 else recip
        b = Stored(cv.constant(f"{node.inputs[1]}_recip", layout.to_stored(data, cl and data.ndim == 4)), cl)
        op = "MUL"
    else:
        b = _operand(cv, node, 1, rank, cl, int8)
    opts = {"ADD": cv.w.options("Add"), "SUB": cv.w.options("Sub"), "MUL": cv.w.options("Mul"),
            "DIV": cv.w.options("Div")}.get(op)
    if int8:
        out = cv.output(node, cl=cl)
        cv.w.add_op(op, [a.tensor, b.tensor], [out.tensor], opts)
    else:
        out = cv.float_output(node, cl=cl)
        cv.w.add_op(op, [a.tensor, b.tensor], [out.tensor], opts)
        cv.finish_float(node, out)


def hard_swish(cv: Converter, node: Node, x_index: int) -> None:
    """Mul(x, HardSigmoid(x; 1/6, 1/2)) -> HARD_SWISH."""
    int8 = cv.int8_mode(node, [x_index])
    if not int8:
        cv.note_float(node)
    x = cv.input_for(node, x_index, int8=int8)
    if int8:
        out = cv.output(node, cl=x.cl)
        cv.w.add_op("HARD_SWISH", [x.tensor], [out.tensor])
    else:
        out = cv.float_output(node, cl=x.cl)
        cv.w.add_op("HARD_SWISH", [x.tensor], [out.tensor])
        cv.finish_float(node, out)


def find_hard_swish(cv: Converter) -> None:
    """Mark float Mul(x, HardSigmoid(x, alpha 1/6, beta 1/2)) pairs: the HardSigmoid is skipped, the Mul converts
    to HARD_SWISH. Quantized pairs stay int8 MUL(x, ADD(MUL(x, alpha), beta)), netquant's own arithmetic: LiteRT's
    int8 HARD_SWISH has no XNNPACK kernel (PP-OCR cls: 11.5 ms vs 1.1 ms decomposed, AMD EPYC)."""
    for node in cv.graph.nodes:
        if node.op_type != "HardSigmoid":
            continue
        alpha, beta = float(node.attrs.get("alpha", 0.2)), float(node.attrs.get("beta", 0.5))
        if abs(alpha - 1 / 6) > 1e-6 or abs(beta - 0.5) > 1e-6:
            continue
        cons = cv.consumers.get(node.outputs[0], [])
        if len(cons) != 1 or cons[0].op_type != "Mul" or cv.graph.is_graph_output(node.outputs[0]):
            continue
        mul = cons[0]
        if sorted(mul.inputs) != sorted([node.inputs[0], node.outputs[0]]) or cv.int8_mode(mul):
            continue
        cv.skip.add(node.name)
        cv.hard_swish[mul.name] = mul.inputs.index(node.inputs[0])


UNARY_FLOAT = {"Sqrt": "SQRT", "Exp": "EXP", "Neg": "NEG", "Abs": "ABS", "Erf": None, "Reciprocal": None}


def unary(cv: Converter, node: Node) -> None:
    """Relu, Clip, Sigmoid, Tanh, HardSwish, LeakyRelu (int8 when quantized); Sqrt, Exp, HardSigmoid float."""
    t = node.op_type
    if t == "HardSigmoid":
        if not _hard_sigmoid_int8(cv, node):
            cv.note_float(node)
            _hard_sigmoid(cv, node, cv.input_for(node, 0, int8=False))
        return
    int8_capable = t in ("Relu", "Clip", "Sigmoid", "Tanh", "HardSwish", "LeakyRelu")
    int8 = int8_capable and cv.int8_mode(node, [0])
    if not int8:
        cv.note_float(node)
    x = cv.input_for(node, 0, int8=int8)
    shape = cv.shape(node.outputs[0])
    fixed: Quant | None = None
    extra: list[Tensor] = []
    opts = None
    if t == "Relu":
        op = "RELU"
    elif t == "Clip":
        lo, hi = _clip_bounds(cv, node)
        op = {(0.0, 6.0): "RELU6", (-1.0, 1.0): "RELU_N1_TO_1", (0.0, math.inf): "RELU",
              (0.0, 1.0): "RELU_0_TO_1"}.get((lo, hi), "")
        if not op:
            _clip_minmax(cv, node, x, lo, hi, int8)
            return
    elif t == "Sigmoid":
        op, fixed = "LOGISTIC", SOFTMAX_QUANT
    elif t == "Tanh":
        op, fixed = "TANH", TANH_QUANT
    elif t == "HardSwish":
        op = "HARD_SWISH"
    elif t == "LeakyRelu":
        op = "LEAKY_RELU"
        opts = cv.w.options("LeakyRelu", alpha=float(node.attrs.get("alpha", 0.01)))
    else:
        op = UNARY_FLOAT.get(t) or ""
        if not op:
            raise ExportError(f"TFLite export: no TFLite conversion for {t} '{node.name}'")
    if int8:
        if fixed is not None:
            out_t = cv.w.add_tensor(node.outputs[0], layout.stored_shape(shape, x.cl), np.int8, fixed)
            cv.w.add_op(op, [x.tensor, *extra], [out_t], opts)
            _requant_output(cv, node, Stored(out_t, x.cl))
            return
        out = cv.output(node, cl=x.cl)
        cv.w.add_op(op, [x.tensor, *extra], [out.tensor], opts)
        return
    out = cv.float_output(node, cl=x.cl)
    cv.w.add_op(op, [x.tensor, *extra], [out.tensor], opts)
    cv.finish_float(node, out)


def _clip_minmax(cv: Converter, node: Node, x: Stored, lo: float, hi: float, int8: bool) -> None:
    if int8:
        cv.note_float(node)
        x = cv.input_for(node, 0, int8=False)
    cur = x.tensor
    for op, bound in (("MAXIMUM", lo), ("MINIMUM", hi)):
        if math.isinf(bound):
            continue
        nxt = cv.w.add_tensor(f"{node.outputs[0]}_{op.lower()}", cur.shape, np.float32)
        cv.w.add_op(op, [cur, cv.constant(f"{node.name}_{op.lower()}", np.array(bound, np.float32))], [nxt])
        cur = nxt
    cv.finish_float(node, Stored(cur, x.cl))


def _hard_sigmoid_int8(cv: Converter, node: Node) -> bool:
    """HardSigmoid on an int8 tensor whose consumers all quantize its output with one set of params q:
    int8 MUL by alpha (output scale alpha * s_x, exact) then ADD beta into q. q's range lies within [0, 1]
    and starts at 0 (calibrated on hard-sigmoid outputs), so saturating to q is the clamp."""
    src = cv.values.get(cv.alias.get(node.inputs[0], node.inputs[0]))
    out = node.outputs[0]
    cons = cv.consumers.get(out, [])
    if src is None or not src.is_int8 or not cons or cv.graph.is_graph_output(out) or cv.out_cfg(node) is not None:
        return False
    quants = {cv.in_quant(c, i) for c in cons for i, n in enumerate(c.inputs) if n == out}
    if len(quants) != 1 or None in quants:
        return False
    q = next(iter(quants))
    assert q is not None and src.tensor.quant is not None
    lo, hi = (-128 - q.zero_point[0]) * q.scale[0], (127 - q.zero_point[0]) * q.scale[0]
    alpha, beta = float(node.attrs.get("alpha", 0.2)), float(node.attrs.get("beta", 0.5))
    if alpha <= 0 or abs(lo) > 1e-6 or hi > 1.0 + q.scale[0]:
        return False
    sx, zx = src.tensor.quant.scale[0], src.tensor.quant.zero_point[0]
    a_t = cv.constant(f"{node.name}_alpha", np.array([127], dtype=np.int8), Quant((alpha / 127.0,), (0,)))
    m = cv.w.add_tensor(f"{out}_scaled", src.tensor.shape, np.int8, Quant((alpha * sx,), (zx,)))
    cv.w.add_op("MUL", [src.tensor, a_t], [m], cv.w.options("Mul"))
    b_scale = max(abs(beta), 1e-8) / 127.0
    b_t = cv.constant(f"{node.name}_beta", np.array([127 if beta >= 0 else -127], dtype=np.int8),
                      Quant((b_scale,), (0,)))
    y = cv.w.add_tensor(out, src.tensor.shape, np.int8, q)
    cv.w.add_op("ADD", [m, b_t], [y], cv.w.options("Add"))
    cv.define(out, Stored(y, src.cl))
    return True


def _hard_sigmoid(cv: Converter, node: Node, x: Stored) -> None:
    """max(0, min(1, alpha x + beta)) in float: MUL, ADD, RELU_0_TO_1."""
    alpha, beta = float(node.attrs.get("alpha", 0.2)), float(node.attrs.get("beta", 0.5))
    shape = x.tensor.shape
    m = cv.w.add_tensor(f"{node.outputs[0]}_scaled", shape, np.float32)
    cv.w.add_op("MUL", [x.tensor, cv.constant(f"{node.name}_alpha", np.array(alpha, np.float32))], [m],
                cv.w.options("Mul"))
    a = cv.w.add_tensor(f"{node.outputs[0]}_shifted", shape, np.float32)
    cv.w.add_op("ADD", [m, cv.constant(f"{node.name}_beta", np.array(beta, np.float32))], [a], cv.w.options("Add"))
    out = cv.float_output(node, cl=x.cl)
    cv.w.add_op("RELU_0_TO_1", [a], [out.tensor])
    cv.finish_float(node, out)


def softmax(cv: Converter, node: Node) -> None:
    """Softmax over the last stored axis -> SOFTMAX (int8 output 1/256, -128)."""
    shape = cv.shape(node.inputs[0])
    rank = len(shape)
    axis = int(node.attrs.get("axis", -1 if cv.graph.opset >= 13 else 1)) % rank
    if cv.graph.opset < 13 and axis != rank - 1:
        raise ExportError(f"TFLite export: Softmax '{node.name}' (opset < 13) flattens from axis {axis}; only the "
                          "last axis converts")
    int8 = cv.int8_mode(node)
    if not int8:
        cv.note_float(node)
    cur = cv.values.get(cv.alias.get(node.inputs[0], node.inputs[0]))
    cl = bool(rank == 4 and axis == 1 and cur is not None and cur.cl)
    if axis != rank - 1 and not cl:
        raise ExportError(f"TFLite export: Softmax '{node.name}' over axis {axis} of a rank-{rank} tensor; "
                          "TFLite's SOFTMAX works on the last axis")
    x = cv.input_for(node, 0, cl=cl if rank == 4 else None, int8=int8)
    opts = cv.w.options("Softmax", beta=1.0)
    if int8:
        out_t = cv.w.add_tensor(node.outputs[0], layout.stored_shape(shape, x.cl), np.int8, SOFTMAX_QUANT)
        cv.w.add_op("SOFTMAX", [x.tensor], [out_t], opts)
        _requant_output(cv, node, Stored(out_t, x.cl))
        return
    out = cv.float_output(node, cl=x.cl)
    cv.w.add_op("SOFTMAX", [x.tensor], [out.tensor], opts)
    cv.finish_float(node, out)


# ---------------------------------------------------------------------------------------------- data movement
def reshape(cv: Converter, node: Node) -> None:
    """Reshape / Flatten / Squeeze / Unsqueeze -> RESHAPE to the recorded static shape (NCHW order)."""
    int8 = _x_int8(cv, node)
    x = cv.input_for(node, 0, cl=False, int8=int8)
    out_shape = cv.shape(node.outputs[0])
    shape_t = cv.constant(f"{node.outputs[0]}_shape", np.array(out_shape, dtype=np.int32))
    _same_params_op(cv, node, "RESHAPE", x, [shape_t], out_shape, False, None, int8)


def transpose(cv: Converter, node: Node) -> None:
    """Transpose -> TRANSPOSE on the stored layout; no op at all when it only changes NCHW <-> NHWC."""
    in_shape = cv.shape(node.inputs[0])
    perm = list(node.attrs.get("perm", list(reversed(range(len(in_shape))))))
    out_shape = cv.shape(node.outputs[0])
    int8 = _x_int8(cv, node)
    cur = cv.values.get(cv.alias.get(node.inputs[0], node.inputs[0]))
    in_cl = bool(cur is not None and cur.cl)
    x = cv.input_for(node, 0, cl=in_cl if len(in_shape) == 4 else None, int8=int8)
    if len(out_shape) == 4 and (cv.out_quant(node) == x.tensor.quant if int8 else cv.out_cfg(node) is None):
        for out_cl in (True, False):
            if layout.compose(perm, x.cl, out_cl) == [0, 1, 2, 3]:
                cv.define(node.outputs[0], Stored(x.tensor, out_cl))  # only the layout changes: no op
                return
    out_cl = False
    stored_perm = layout.compose(perm, x.cl, out_cl)
    perm_t = cv.constant(f"{node.name}_perm", np.array(stored_perm, dtype=np.int32))
    _same_params_op(cv, node, "TRANSPOSE", x, [perm_t], out_shape, out_cl, None, int8)


def concat(cv: Converter, node: Node) -> None:
    """Concat -> CONCATENATION (int8: every input brought to the output's params)."""
    out_shape = cv.shape(node.outputs[0])
    rank = len(out_shape)
    axis = int(node.attrs.get("axis", 0)) % rank
    cl = _wants_cl(cv, node, rank)
    idx = [i for i, n in enumerate(node.inputs) if n]
    int8 = cv.int8_mode(node, [i for i in idx if not cv.is_const(node.inputs[i])])
    if not int8:
        cv.note_float(node)
    q = cv.out_quant(node) if int8 else None
    parts = []
    for i in idx:
        name = node.inputs[i]
        if cv.is_const(name):
            parts.append(cv._const_value(name, cl, q).tensor)
        elif int8:
            parts.append(cv.get(name, cl=cl if rank == 4 else None, quant=q).tensor)
        else:
            parts.append(cv.input_for(node, i, cl=cl if rank == 4 else None, int8=False).tensor)
    opts = cv.w.options("Concatenation", axis=layout.stored_axis(axis, rank, cl))
    if int8:
        out = cv.output(node, cl=cl)
        cv.w.add_op("CONCATENATION", parts, [out.tensor], opts)
    else:
        out = cv.float_output(node, cl=cl)
        cv.w.add_op("CONCATENATION", parts, [out.tensor], opts)
        cv.finish_float(node, out)


def slice_(cv: Converter, node: Node) -> None:
    """Slice (constant starts / ends / axes / steps) -> STRIDED_SLICE on the stored layout."""
    in_shape = cv.shape(node.inputs[0])
    rank = len(in_shape)
    if "starts" in node.attrs:  # opset < 10
        starts, ends = list(node.attrs["starts"]), list(node.attrs["ends"])
        axes = list(node.attrs.get("axes", range(len(starts))))
        steps = [1] * len(starts)
    else:
        for k in node.inputs[1:]:
            if k and not cv.is_const(k):
                raise ExportError(f"TFLite export: Slice '{node.name}' has non-constant bounds '{k}'")
        starts, ends = _ints(cv, node.inputs[1]), _ints(cv, node.inputs[2])
        axes = _ints(cv, node.inputs[3]) if len(node.inputs) > 3 and node.inputs[3] else list(range(len(starts)))
        steps = _ints(cv, node.inputs[4]) if len(node.inputs) > 4 and node.inputs[4] else [1] * len(starts)
    int8 = _x_int8(cv, node)
    x = cv.input_for(node, 0, int8=int8)
    begin, end, stride = [0] * rank, list(layout.stored_shape(in_shape, x.cl)), [1] * rank
    for s, e, a, st in zip(starts, ends, axes, steps):
        a %= rank
        dim = in_shape[a]
        if st < 0:
            raise ExportError(f"TFLite export: Slice '{node.name}' has a negative step")
        s = min(max(s + dim if s < 0 else s, 0), dim)
        e = min(max(e + dim if e < 0 else e, 0), dim)
        k = layout.stored_axis(a, rank, x.cl)
        begin[k], end[k], stride[k] = s, e, st
    consts = [cv.constant(f"{node.name}_{n}", np.array(v, dtype=np.int32))
              for n, v in (("begin", begin), ("end", end), ("strides", stride))]
    _same_params_op(cv, node, "STRIDED_SLICE", x, consts, cv.shape(node.outputs[0]), x.cl,
                    cv.w.options("StridedSlice"), int8)


def identity(cv: Converter, node: Node) -> None:
    """Identity / Dropout / float->float Cast: the output is the input."""
    if node.op_type == "Cast":
        from netquant.graph.dtypes import ONNX_TO_TORCH

        to = ONNX_TO_TORCH.get(int(node.attrs.get("to", 1)))
        if to is None or not to.is_floating_point:
            raise ExportError(f"TFLite export: Cast '{node.name}' to a non-float type on a data path")
    cv.alias[node.outputs[0]] = cv.alias.get(node.inputs[0], node.inputs[0])


CONVERTERS: dict[str, OpConverter] = {
    "Conv": conv, "MatMul": matmul, "Gemm": gemm,
    "MaxPool": pool, "AveragePool": pool, "GlobalAveragePool": global_pool, "GlobalMaxPool": global_pool,
    "ReduceMean": reduce_mean,
    **{t: binary for t in BINARY},
    **{t: unary for t in ("Relu", "Clip", "Sigmoid", "Tanh", "HardSwish", "LeakyRelu", "HardSigmoid", "Sqrt",
                          "Exp", "Neg", "Abs")},
    "Softmax": softmax,
    "Reshape": reshape, "Flatten": reshape, "Squeeze": reshape, "Unsqueeze": reshape,
    "Transpose": transpose, "Concat": concat, "Slice": slice_,
    "Identity": identity, "Dropout": identity, "Cast": identity,
}
