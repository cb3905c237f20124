"""Dynamic activation quantization of MatMul regions in a QDQ model (onnxruntime's quantize_dynamic form).

A static QDQ MatMul           x -> Q(s_x, z_x) -> DQ -> MatMul <- DQ(w_q, s_w, z_w)
becomes                       x -> DynamicQuantizeLinear -> (x_q, s, z)
                              MatMulInteger(x_q, w_q, z, z_w) -> Cast(float) -> Mul(s * s_w) -> y
with the same int8 weight codes: the activation's scale and zero point come from each input's own min / max
(uint8 affine, per tensor: s = (max(0, max x) - min(0, min x)) / 255) instead of calibration. onnxruntime fuses the
chain (with a following bias Add) into DynamicQuantizeMatMul / MatMulIntegerToFloat; the new nodes keep the
MatMul's name as a prefix and MatMulInteger its name, so profiles map them back to the region.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import onnx
from onnx import TensorProto, helper, numpy_helper

from netquant.graph.light import remove_where


def _init_dims(graph: onnx.GraphProto) -> dict[str, list[int]]:
    return {t.name: list(t.dims) for t in graph.initializer}


def _attr(node: onnx.NodeProto, name: str, default: int) -> int:
    return next((int(a.i) for a in node.attribute if a.name == name), default)


def make_dynamic(model: onnx.ModelProto, matmuls: Iterable[str]) -> list[str]:
    """Rewrite each MatMul named in `matmuls` to dynamic activation quantization (module docstring), in place.
    Only a MatMul whose input 0 is DQ(Q(x)) with a uint8 Q and input 1 a DequantizeLinear of an int8 initializer
    (per tensor, or per column of a 2-D weight; zero point given or omitted, and omitted in MatMulInteger where it
    is all zero) is rewritten; returns the names rewritten. Q / DQ nodes no other
    node reads any more are removed."""
    graph = model.graph
    wanted = set(matmuls)
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, int] = defaultdict(int)
    for n in graph.node:
        for i in n.input:
            readers[i] += 1
    dims = _init_dims(graph)
    types = {t.name: t.data_type for t in graph.initializer}
    zero_codes = {t.name for t in graph.initializer if t.data_type == TensorProto.INT8
                  and not numpy_helper.to_array(t).any()}
    done: list[str] = []
    new_nodes: dict[str, list[onnx.NodeProto]] = {}
    for mm in graph.node:
        if mm.op_type != "MatMul" or mm.name not in wanted:
            continue
        dq_x, dq_w = producer.get(mm.input[0]), producer.get(mm.input[1])
        if dq_x is None or dq_w is None or dq_x.op_type != "DequantizeLinear" or dq_w.op_type != "DequantizeLinear":
            continue
        q_x = producer.get(dq_x.input[0])
        if q_x is None or q_x.op_type != "QuantizeLinear" or len(q_x.input) < 3 or \
                types.get(q_x.input[2]) != TensorProto.UINT8:
            continue
        w_q, w_s = dq_w.input[0], dq_w.input[1]
        w_z = dq_w.input[2] if len(dq_w.input) > 2 else ""
        if w_z and w_z in zero_codes:  # an all-zero int8 zero point is MatMulInteger's default: not stored
            w_z = ""
        if types.get(w_q) != TensorProto.INT8 or len(dims.get(w_q, [])) != 2:
            continue
        per_column = len(dims.get(w_s, [])) == 1 and dims[w_s][0] > 1
        if per_column and _attr(dq_w, "axis", 1) not in (1, -1):
            continue
        x, p = q_x.input[0], mm.name
        names = {k: f"{p}/dynamic_{k}" for k in ("x_q", "x_scale", "x_zero_point", "int32", "float", "scale")}
        new_nodes[mm.name] = [
            helper.make_node("DynamicQuantizeLinear", [x], [names["x_q"], names["x_scale"], names["x_zero_point"]],
                             name=f"{p}/DynamicQuantizeLinear"),
            helper.make_node("MatMulInteger", [names["x_q"], w_q, names["x_zero_point"]] + ([w_z] if w_z else []),
                             [names["int32"]], name=p),
            helper.make_node("Cast", [names["int32"]], [names["float"]], name=f"{p}/Cast", to=TensorProto.FLOAT),
            helper.make_node("Mul", [names["x_scale"], w_s], [names["scale"]], name=f"{p}/scale"),
            helper.make_node("Mul", [names["float"], names["scale"]], [mm.output[0]], name=f"{p}/Mul"),
        ]
        for dq in (dq_x, dq_w):
            readers[dq.output[0]] -= 1
        done.append(mm.name)
    if not done:
        return done
    out: list[onnx.NodeProto] = []
    for n in graph.node:
        if n.name in new_nodes and n.op_type == "MatMul":
            out.extend(new_nodes[n.name])
        else:
            out.append(n)
    # drop the Q / DQ nodes nobody reads any more (repeatedly: a DQ gone may leave its Q unread)
    outputs = {o.name for o in graph.output}
    for _ in range(2):
        count: dict[str, int] = defaultdict(int)
        for n in out:
            for i in n.input:
                count[i] += 1
        out = [n for n in out if n.op_type not in ("QuantizeLinear", "DequantizeLinear", "Clip")
               or any(count[o] or o in outputs for o in n.output)]
    del graph.node[:]
    graph.node.extend(out)
    used = {i for n in out for i in n.input}
    remove_where(graph.initializer, lambda t: t.name not in used and t.name not in outputs)
    return done
