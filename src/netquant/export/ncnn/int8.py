"""ncnn2int8's transformation with netquant's numbers: Convolution / ConvolutionDepthWise / InnerProduct layers
of an FP32 ncnn model get int8 weights and scales.

ncnn's int8 layers (src/layer/convolution.cpp etc., tools/quantize/ncnn2int8.cpp): param 8 (int8_scale_term) = 2
for Convolution and InnerProduct (per-output-channel weight scales), 1 for ConvolutionDepthWise (one weight scale
per group); the weight array is stored int8 (tag 0x000D4B38), and after the bias come the weight scales
(num_output or group float32 values) and the bottom blob scale (one float32). ncnn's scales are multipliers:
q = clamp(round(x * scale), -127, 127), scale = 127 / amax = 1 / (netquant's scale); the layer computes
y = sum(q_x * q_w) / (bottom_scale * weight_scale[c]) + bias in float.

Each ncnn layer is matched to the netquant op whose FP32 weight it holds (pnnx keeps weights exactly but renames
layers); its int8 weights are netquant's integer codes, its scales netquant's calibrated ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from netquant.core.int_kernels import quantize_limited
from netquant.core.spec import Granularity
from netquant.core.tensor_config import TensorQuantConfig
from netquant.errors import ExportError
from netquant.export.ncnn.modelbin import Segment, decode, encode_float32, encode_int8, walk
from netquant.export.ncnn.param import NcnnLayer, NcnnParam
from netquant.export.slots import params_of, root
from netquant.graph.ir import Node
from netquant.passes.quant_graph import QuantizedGraph

INT8_LAYER_TYPES = ("Convolution", "ConvolutionDepthWise", "InnerProduct")
_OUT_AXIS = {"Conv": 0, "MatMul": 1}


@dataclass
class WeightedOp:
    """A netquant op ncnn can run in int8: its FP32 weight and integer codes in ncnn's layout ([out, rest]),
    per-output-channel weight scales and its input's per-tensor scale (netquant's convention: x ~ scale * q)."""

    node: str
    op_type: str
    weight: np.ndarray  # float32 [out, rest]
    codes: np.ndarray  # int8 [out, rest]
    weight_scale: np.ndarray  # float32 [out]
    input_scale: float


@dataclass
class Int8Layer:
    """One ncnn layer turned int8: which op it came from, and the scales in ncnn's convention (1 / netquant's)."""

    layer: str
    layer_type: str
    node: str
    int8_scale_term: int
    codes: np.ndarray  # int8, ncnn's flat weight order
    weight_scales: np.ndarray  # float32: per output channel (Convolution, InnerProduct) or per group
    bottom_scale: np.float32


@dataclass
class Int8Plan:
    """The layers to turn int8 and what stays float (with why)."""

    layers: list[Int8Layer] = field(default_factory=list)
    unmatched_ops: list[str] = field(default_factory=list)  # netquant-quantized ops no ncnn layer could take
    warnings: list[str] = field(default_factory=list)


def ncnn_scale(netquant_scale: np.ndarray | float) -> np.ndarray:
    """ncnn's multiplier 1 / s as float32 (s: netquant's scale, x ~ s * q)."""
    return (1.0 / np.asarray(netquant_scale, dtype=np.float64)).astype(np.float32)


def weighted_ops(qgraph: QuantizedGraph) -> tuple[list[WeightedOp], list[str]]:
    """Conv / Gemm / MatMul ops whose input 0 and constant weight are both quantized (8-bit symmetric), in graph
    order; plus warnings for quantized ops ncnn's int8 scheme cannot express."""
    graph = qgraph.graph
    ops, warnings = [], []
    for node in graph.nodes:
        if node.op_type not in ("Conv", "Gemm", "MatMul"):
            continue
        oc = qgraph.op_configs.get(node.name)
        if oc is None or len(node.inputs) < 2 or node.inputs[1] not in graph.initializers:
            continue
        a_cfg, w_cfg = (oc.inputs[i] if i < len(oc.inputs) else None for i in (0, 1))
        if not (_quantized(a_cfg) and _quantized(w_cfg)):
            continue
        why = _unsupported(node, a_cfg, w_cfg)
        if why:
            warnings.append(f"{node.op_type} '{node.name}' stays float in ncnn: {why}")
            continue
        op = _weighted_op(qgraph, node, a_cfg, w_cfg)
        if op is None:
            warnings.append(f"{node.op_type} '{node.name}' stays float in ncnn: its weight layout has no ncnn "
                            "int8 counterpart")
            continue
        ops.append(op)
    return ops, warnings


def _quantized(cfg: TensorQuantConfig | None) -> bool:
    """The tensor is quantized where this config sits: its own quantizer, or one it shares (OVERLAPPED: the
    producer's output quantizer; ncnn then quantizes the layer's input with those params)."""
    return cfg is not None and cfg.is_active and root(cfg).params is not None


def _unsupported(node: Node, a_cfg: TensorQuantConfig, w_cfg: TensorQuantConfig) -> str:
    a_scale, a_zp, a_spec = params_of(a_cfg)
    w_scale, w_zp, w_spec = params_of(w_cfg)
    if a_spec.is_float or w_spec.is_float:
        return "ncnn int8 has no floating-point 8-bit formats"
    if a_spec.granularity is not Granularity.PER_TENSOR or a_scale.numel() != 1:
        return "ncnn quantizes a layer's input with one scale"
    if bool((a_zp != 0).any()) or bool((w_zp != 0).any()):
        return "ncnn int8 is symmetric (zero point 0)"
    if not a_spec.signed or a_spec.qmax != 127 or a_spec.qmin < -128:
        return f"ncnn quantizes inputs to [-127, 127], this input's range is [{a_spec.qmin}, {a_spec.qmax}]"
    if not w_spec.signed or w_spec.qmax > 127 or w_spec.qmin < -127:
        return f"ncnn stores weights in [-127, 127], these are in [{w_spec.qmin}, {w_spec.qmax}]"
    if w_spec.granularity not in (Granularity.PER_TENSOR, Granularity.PER_CHANNEL):
        return "ncnn weight scales are per output channel (no per-group scales)"
    return ""


def _weighted_op(qgraph: QuantizedGraph, node: Node, a_cfg: TensorQuantConfig, w_cfg: TensorQuantConfig) -> WeightedOp | None:
    weight = qgraph.graph.initializers[node.inputs[1]].detach().float().cpu()
    w_scale, w_zp, w_spec = params_of(w_cfg)
    codes = quantize_limited(weight, w_scale, w_zp, w_spec, w_cfg.effective_pair_limit).to(torch.int64)
    if node.op_type == "Conv":
        out_axis = 0
    elif node.op_type == "Gemm":
        if int(node.attrs.get("transA", 0)) or float(node.attrs.get("alpha", 1.0)) != 1.0 or weight.dim() != 2:
            return None
        out_axis = 0 if int(node.attrs.get("transB", 0)) else 1
    else:  # MatMul with a constant [K, N] weight
        if weight.dim() != 2:
            return None
        out_axis = 1
    if w_spec.granularity is Granularity.PER_CHANNEL:
        if (w_spec.axis % weight.dim()) != out_axis:
            return None
        scales = w_scale.reshape(-1)
    else:
        scales = w_scale.reshape(1).expand(weight.shape[out_axis])
    w = weight.movedim(out_axis, 0).reshape(weight.shape[out_axis], -1)
    q = codes.movedim(out_axis, 0).reshape(weight.shape[out_axis], -1)
    a_scale = float(params_of(a_cfg)[0].reshape(()))
    return WeightedOp(node.name, node.op_type, w.numpy().astype(np.float32), q.numpy().astype(np.int8),
                      scales.numpy().astype(np.float32).copy(), a_scale)


def _same_weight(ncnn_weight: np.ndarray, op: WeightedOp) -> bool:
    ref = op.weight.reshape(-1)
    if ncnn_weight.shape != ref.shape:
        return False
    tol = 1e-5 * max(float(np.abs(ref).max(initial=0.0)), 1e-12)
    return bool(np.allclose(ncnn_weight, ref, rtol=1e-5, atol=tol))


def plan_int8(param: NcnnParam, data: bytes, qgraph: QuantizedGraph, where: str = "ncnn model") -> Int8Plan:
    """Match every float Convolution / ConvolutionDepthWise / InnerProduct layer to the netquant op holding the same
    FP32 weight, and the int8 layer each becomes."""
    ops, warnings = weighted_ops(qgraph)
    plan = Int8Plan(warnings=list(warnings))
    segments = walk(param, data, where)
    weights = {s.layer: s for s in segments if s.name == "weight"}
    used: set[str] = set()
    for layer in param.layers:
        if layer.type not in INT8_LAYER_TYPES or layer.int_param(8) or layer.name not in weights:
            continue
        seg = weights[layer.name]
        values = decode(seg, data)
        if values.dtype != np.float32:
            continue
        match = next((op for op in ops if op.node not in used and _same_weight(values, op)), None)
        if match is None:
            continue
        int8 = _int8_layer(layer, match, plan.warnings)
        if int8 is not None:
            used.add(match.node)
            plan.layers.append(int8)
    plan.unmatched_ops = [op.node for op in ops if op.node not in used]
    return plan


def _int8_layer(layer: NcnnLayer, op: WeightedOp, warnings: list[str]) -> Int8Layer | None:
    out = op.codes.shape[0]
    if layer.int_param(0) != out:
        return None
    bottom = ncnn_scale(op.input_scale).reshape(())
    if layer.type == "ConvolutionDepthWise":
        group = layer.int_param(7, 1)
        per_group = op.weight_scale.reshape(group, -1)
        if not np.all(per_group == per_group[:, :1]):
            warnings.append(f"ncnn layer '{layer.name}' ({op.op_type} '{op.node}') stays float: ncnn's grouped "
                            "convolution has one weight scale per group, netquant's differ within a group")
            return None
        return Int8Layer(layer.name, layer.type, op.node, 1, op.codes.reshape(-1), ncnn_scale(per_group[:, 0]),
                         np.float32(bottom))
    return Int8Layer(layer.name, layer.type, op.node, 2, op.codes.reshape(-1), ncnn_scale(op.weight_scale),
                     np.float32(bottom))


def apply_int8(param: NcnnParam, data: bytes, layers: Sequence[Int8Layer], where: str = "ncnn model") -> bytes:
    """Set int8_scale_term on `layers` in `param` (in place) and return the rewritten .bin."""
    by_name = {la.layer: la for la in layers}
    segments = walk(param, data, where)
    last: dict[str, Segment] = {}
    for s in segments:
        last[s.layer] = s
    out = bytearray()
    for s in segments:
        int8 = by_name.get(s.layer)
        if int8 is not None and s.name == "weight":
            if int8.codes.size != s.count:
                raise ExportError(f"{where}: layer '{s.layer}' holds {s.count} weights, netquant's op "
                                  f"'{int8.node}' {int8.codes.size}")
            out += encode_int8(int8.codes)
        else:
            out += data[s.offset:s.offset + s.nbytes]
        if int8 is not None and last[s.layer] is s:
            out += encode_float32(int8.weight_scales) + encode_float32(np.array([int8.bottom_scale]))
    for layer in param.layers:
        if layer.name in by_name:
            layer.params[8] = str(by_name[layer.name].int8_scale_term)
    return bytes(out)
