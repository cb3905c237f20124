"""Exact rewrites of a QDQ model so that onnxruntime's QDQ selectors still find their patterns after its other
fusions.

onnxruntime's MatMulAddFusion turns a MatMul with a rank >= 3 input followed by an Add of a 1-D bias into
Reshape -> Gemm -> Reshape. On a QDQ MatMul (DequantizeLinear on both inputs) that rewrite runs first and leaves the
DequantizeLinear nodes in front of a float Gemm: no int8 kernel runs and every run dequantizes the weights again
(BERT-style encoders exported with static shapes ran 2.1x slower than FP32). The fusion accepts only a bias of shape
[N] (or 2-D ones for a 2-D MatMul), so giving the bias the MatMul output's rank, [1, ..., 1, N], keeps the MatMul
apart; the Add broadcasts the same values (exact), and onnxruntime fuses DQ -> MatMul into MatMulIntegerToFloat.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from netquant.graph.ir import claim_name
from netquant.graph.light import remove_where


def _initializer_rank1(graph: onnx.GraphProto, name: str) -> onnx.TensorProto | None:
    for t in graph.initializer:
        if t.name == name:
            return t if len(t.dims) == 1 else None
    return None


def _source_rank(name: str, producer: dict[str, onnx.NodeProto], rank_of: Callable[[str], int | None]) -> int:
    """rank_of the tensor a chain of Q / Clip / DQ nodes ending in `name` started from (0 when unknown)."""
    for _ in range(4):
        rank = rank_of(name)
        if rank is not None:
            return rank
        node = producer.get(name)
        if node is None or node.op_type not in ("DequantizeLinear", "QuantizeLinear", "Clip"):
            return 0
        name = node.input[0]
    return 0


def keep_qdq_matmul_bias_apart(model: onnx.ModelProto, rank_of: Callable[[str], int | None]) -> int:
    """Reshape the 1-D bias of every Add that follows a QDQ MatMul (both inputs from DequantizeLinear) with an input
    of rank >= 3 to [1, ..., 1, N] (the MatMul output's rank), in place; returns how many biases were reshaped.

    rank_of: the rank of a tensor of the source graph by name, None when unknown (such MatMuls are left alone); the
    MatMul's input is traced back through its DequantizeLinear / Clip / QuantizeLinear to the source tensor. A bias
    that other nodes also read gets a reshaped copy, one per rank that all its MatMul Adds share."""
    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            readers[i].append(n)
    outputs = {o.name for o in graph.output}
    taken = {t.name for t in graph.initializer} | set(producer) | {i.name for i in graph.input}
    copies: dict[tuple[str, int], str] = {}
    changed = 0
    for mm in list(graph.node):
        if mm.op_type != "MatMul" or mm.domain not in ("", "ai.onnx") or len(mm.input) != 2:
            continue
        if any(getattr(producer.get(i), "op_type", None) != "DequantizeLinear" for i in mm.input):
            continue
        rank = _source_rank(mm.input[0], producer, rank_of)
        users = readers.get(mm.output[0], [])
        if rank < 3 or len(users) != 1 or mm.output[0] in outputs or users[0].op_type != "Add":
            continue
        add = users[0]
        index = 1 if add.input[0] == mm.output[0] else 0
        bias = _initializer_rank1(graph, add.input[index])
        if bias is None:
            continue
        dims = [1] * (rank - 1) + [int(bias.dims[0])]
        if len(readers[bias.name]) == 1:
            del bias.dims[:]
            bias.dims.extend(dims)
        elif (bias.name, rank) in copies:  # one reshaped copy per shared bias and rank (exporters share equal ones)
            add.input[index] = copies[(bias.name, rank)]
        else:
            name, k = f"{bias.name}_rank{rank}", 1
            while name in taken:
                name, k = f"{bias.name}_rank{rank}_{k}", k + 1
            taken.add(name)
            copy = onnx.TensorProto()
            copy.CopyFrom(bias)
            copy.name = name
            del copy.dims[:]
            copy.dims.extend(dims)
            graph.initializer.append(copy)
            add.input[index] = name
            copies[(bias.name, rank)] = name
        changed += 1
    if changed:  # value_info of a reshaped bias (if any) no longer holds
        stored = {t.name for t in graph.initializer}
        remove_where(graph.value_info, lambda v: v.name in stored)
    return changed


__all__ = ["embed_layer_norm_rows", "keep_qdq_matmul_bias_apart"]


ROW_CODES = 255  # passes.embeddings.coded_row_scales: row scales c * step, c in 1..255


def _row_scale_column(values: np.ndarray) -> tuple[np.ndarray | None, float | None]:
    """The per-row scales [V] (float32) as the file stores them: (None, s) where every row has the scale s; (uint8
    codes c [V, 1], step) where values == float32(c * step) exactly, step = max / 255 (passes.embeddings'
    coded_row_scales); else (float16 [V, 1], None) where float16 holds every one exactly; else (float32 [V, 1],
    None)."""
    if values.size and (values == values[0]).all():
        return None, float(values[0])
    top = np.float32(values.max()) if values.size else np.float32(0)
    if np.isfinite(top) and top > 0:
        step = np.float32(top / np.float32(ROW_CODES))
        codes = np.rint(values / step)
        if ((codes >= 1) & (codes <= ROW_CODES)).all() and \
                (codes.astype(np.float32) * step == values).all():
            return codes.astype(np.uint8).reshape(-1, 1), float(step)
    half = values.astype(np.float16)
    if np.isfinite(half).all() and (half.astype(np.float32) == values).all():
        return half.reshape(-1, 1), None
    return values.reshape(-1, 1), None


def gather_int8_rows(model: onnx.ModelProto) -> int:
    """Rewrite DequantizeLinear(int8 table [V, D], per-row scale [V], zero zero points, axis 0) -> Gather(axis 0) into
    Gather(codes) -> Cast(float) -> Mul(row scales), in place (passes.embeddings): the same values, but only the
    gathered rows are dequantized each run (onnxruntime does not fold a DequantizeLinear of an initializer, so the
    first form dequantizes the whole table on every run). The row scales are _row_scale_column's: one scalar where
    every row has the same scale; Cast(Gather(uint8 codes [V, 1])) * step (exact in float32) where the scales are
    c * step; else Gather of a float16 column Cast to float (where float16 holds every scale exactly) or of a float
    column. Gathers of one table (e.g. the word embeddings read by EmbedLayerNormalization and by another Gather)
    share one scale column. Returns how many Gathers were rewritten."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    readers = _read_counts(graph)
    taken = set(inits) | set(producer) | {i.name for i in graph.input}

    fresh = functools.partial(claim_name, taken=taken)

    def add(array: np.ndarray, name: str) -> str:
        tensor = numpy_helper.from_array(array, fresh(name))
        graph.initializer.append(tensor)
        inits[tensor.name] = tensor
        return tensor.name

    replaced: dict[int, list[onnx.NodeProto]] = {}
    columns: dict[str, tuple[str | None, str | None, int]] = {}  # scale -> (column, scalar, column's dtype)
    for gather in graph.node:
        if gather.op_type != "Gather" or gather.domain not in ("", "ai.onnx") or \
                next((a.i for a in gather.attribute if a.name == "axis"), 0) != 0:
            continue
        dq = producer.get(gather.input[0])
        if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 2:
            continue
        codes, scale = inits.get(dq.input[0]), inits.get(dq.input[1])
        zero = inits.get(dq.input[2]) if len(dq.input) > 2 and dq.input[2] else None
        if codes is None or scale is None or codes.data_type != onnx.TensorProto.INT8 or len(codes.dims) != 2 or \
                list(scale.dims) != [codes.dims[0]] or \
                next((a.i for a in dq.attribute if a.name == "axis"), 1) not in (0, -2) or \
                (zero is not None and numpy_helper.to_array(zero).any()):
            continue
        if scale.name not in columns:  # one scale column per table, however many Gathers read it
            column, scalar = _row_scale_column(numpy_helper.to_array(scale).astype(np.float32).reshape(-1))
            columns[scale.name] = (
                None if column is None else add(column, f"{scale.name}_rows"),
                None if scalar is None else add(np.array(scalar, np.float32),
                                                f"{scale.name}_{'shared' if column is None else 'step'}"),
                0 if column is None else helper.np_dtype_to_tensor_dtype(column.dtype))
        column_name, scalar_name, dtype = columns[scale.name]
        p = gather.name or fresh("embedding")
        rows, as_float = fresh(f"{p}/int8_rows"), fresh(f"{p}/rows")
        new = [helper.make_node("Gather", [codes.name, gather.input[1]], [rows], name=gather.name, axis=0),
               helper.make_node("Cast", [rows], [as_float], name=fresh(f"{p}/Cast"), to=onnx.TensorProto.FLOAT)]
        if column_name is None:  # one scale for the table
            row_scales = scalar_name
        else:
            row_scales = fresh(f"{p}/row_scales")
            gathered = row_scales if dtype == onnx.TensorProto.FLOAT else fresh(f"{p}/row_scale_codes")
            new.append(helper.make_node("Gather", [column_name, gather.input[1]], [gathered], name=fresh(f"{p}/scales"),
                                        axis=0))
            if dtype != onnx.TensorProto.FLOAT:
                as_scales = row_scales if scalar_name is None else fresh(f"{p}/row_scale_code_floats")
                new.append(helper.make_node("Cast", [gathered], [as_scales], name=fresh(f"{p}/CastScales"),
                                            to=onnx.TensorProto.FLOAT))
                if scalar_name is not None:  # c * step: exact in float32
                    new.append(helper.make_node("Mul", [as_scales, scalar_name], [row_scales],
                                                name=fresh(f"{p}/scale_step")))
        new.append(helper.make_node("Mul", [as_float, row_scales], [gather.output[0]], name=fresh(f"{p}/dequantize")))
        replaced[id(gather)] = new
        readers[dq.output[0]] -= 1
    if not replaced:
        return 0
    outputs = {o.name for o in graph.output}
    nodes = _splice(graph, replaced, readers)
    used = {i for n in nodes for i in n.input}
    remove_where(graph.initializer, lambda t: t.name not in used and t.name not in outputs)
    return len(replaced)


def drop_zero_weight_zero_points(model: onnx.ModelProto, rank_of: Callable[[str], int | None]) -> int:
    """Remove the all-zero zero-point input of DequantizeLinear nodes of int8 initializers (symmetric weights) that
    only MatMuls with an input of rank >= 3 read, in place: an omitted zero point is 0 (ONNX), onnxruntime fuses
    DQ -> MatMul into MatMulIntegerToFloat the same, and the file loses one int8 per output channel per weight.
    (Its Gemm selector, which a 2-D MatMul + Add becomes, needs the zero point: those keep it.) Returns how many
    zero points were dropped."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    readers: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in graph.node:
        for i in n.input:
            readers[i].append(n)
    dropped = 0
    for node in graph.node:
        if node.op_type != "DequantizeLinear" or len(node.input) != 3 or not node.input[2]:
            continue
        users = readers.get(node.output[0], [])
        if not users or any(u.op_type != "MatMul" or u.input[1] != node.output[0] or
                            _source_rank(u.input[0], producer, rank_of) < 3 for u in users):
            continue
        x, zero = inits.get(node.input[0]), inits.get(node.input[2])
        if x is None or zero is None or x.data_type != onnx.TensorProto.INT8 or \
                zero.data_type != onnx.TensorProto.INT8 or numpy_helper.to_array(zero).any():
            continue
        del node.input[2]
        dropped += 1
    if dropped:
        used = {i for n in graph.node for i in n.input} | {o.name for o in graph.output}
        remove_where(graph.initializer, lambda t: t.name not in used)
    return dropped


def q_attention(model: onnx.ModelProto) -> int:
    """Rewrite com.microsoft Attention(DQ(Q(x)), DQ(int8 weights), bias, mask...) into QAttention(Q(x), weights,
    bias, s_x, s_w, mask, z_x, z_w), in place: the same arithmetic (onnxruntime's QAttention dequantizes with those
    scales) in onnxruntime's int8 attention kernel; an all-zero z_w is left out (omitted means 0) and its
    initializer dropped where nothing else reads it. Attentions with a past input are left alone. Returns the
    count."""
    from onnx import numpy_helper

    graph = model.graph
    producer = {o: n for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}
    readers = _read_counts(graph)
    replaced: dict[int, onnx.NodeProto] = {}
    dropped: set[str] = set()  # zero points left out of a QAttention
    for node in graph.node:
        if node.op_type != "Attention" or node.domain != "com.microsoft" or len(node.input) < 3 or \
                (len(node.input) > 4 and any(node.input[4:])):
            continue
        dq_x, dq_w = producer.get(node.input[0]), producer.get(node.input[1])
        if dq_x is None or dq_w is None or dq_x.op_type != "DequantizeLinear" or dq_w.op_type != "DequantizeLinear":
            continue
        q_x = producer.get(dq_x.input[0])
        w = inits.get(dq_w.input[0])
        if q_x is None or q_x.op_type != "QuantizeLinear" or w is None or w.data_type != onnx.TensorProto.INT8 or \
                len(dq_x.input) < 3 or len(dq_w.input) < 3:
            continue
        mask = node.input[3] if len(node.input) > 3 else ""
        inputs = [dq_x.input[0], dq_w.input[0], node.input[2], dq_x.input[1], dq_w.input[1], mask, dq_x.input[2]]
        z_w = inits.get(dq_w.input[2])
        if z_w is None or numpy_helper.to_array(z_w).any():  # an omitted weight zero point is 0: one int8 a column
            inputs.append(dq_w.input[2])
        else:
            dropped.add(z_w.name)
        replaced[id(node)] = helper.make_node("QAttention", inputs, list(node.output), name=node.name,
                                              domain="com.microsoft", **{a.name: helper.get_attribute_value(a)
                                                                         for a in node.attribute})
        readers[dq_x.output[0]] -= 1
        readers[dq_w.output[0]] -= 1
    if not replaced:
        return 0
    nodes = _splice(graph, {k: [v] for k, v in replaced.items()}, readers)
    used = {i for n in nodes for i in n.input} | {o.name for o in graph.output}
    remove_where(graph.initializer, lambda t: t.name not in used and t.name in dropped)
    return len(replaced)


def _read_counts(graph: onnx.GraphProto) -> dict[str, int]:
    """How many node inputs read each value (0 for anything else)."""
    readers: dict[str, int] = defaultdict(int)
    for n in graph.node:
        for i in n.input:
            readers[i] += 1
    return readers


def _splice(graph: onnx.GraphProto, replaced: dict[int, list[onnx.NodeProto]], readers: dict[str, int]
            ) -> list[onnx.NodeProto]:
    """The graph's nodes with each replaced one (by id) swapped for its new nodes, and the DequantizeLinear nodes no
    node reads any more (readers count 0, not a graph output) dropped; written back to `graph` and returned."""
    outputs = {o.name for o in graph.output}
    nodes: list[onnx.NodeProto] = []
    for n in graph.node:
        if id(n) in replaced:
            nodes.extend(replaced[id(n)])
        elif n.op_type == "DequantizeLinear" and readers[n.output[0]] <= 0 and n.output[0] not in outputs:
            continue
        else:
            nodes.append(n)
    del graph.node[:]
    graph.node.extend(nodes)
    return nodes



def _is_int8_rows(dq: onnx.NodeProto | None, inits: dict[str, onnx.TensorProto]) -> bool:
    """dq is DequantizeLinear(int8 [V, D] initializer, per-row scale [V], axis 0): an int8-rows embedding table."""
    if dq is None or dq.op_type != "DequantizeLinear" or len(dq.input) < 2:
        return False
    codes, scale = inits.get(dq.input[0]), inits.get(dq.input[1])
    return codes is not None and scale is not None and codes.data_type == onnx.TensorProto.INT8 and \
        len(codes.dims) == 2 and list(scale.dims) == [codes.dims[0]] and \
        next((a.i for a in dq.attribute if a.name == "axis"), 1) in (0, -2)


def embed_layer_norm_rows(model: onnx.ModelProto) -> int:
    """Rewrite com.microsoft EmbedLayerNormalization(input_ids, segment_ids, DQ(word), DQ(position), segment, gamma,
    beta, mask, position_ids) whose word table is int8 rows (passes.embeddings) into its definition, in place:
    e = Gather(word, input_ids) + Gather(position, position_ids or Range(0, S)) [+ Gather(segment, segment_ids)],
    y = LayerNormalization(e, gamma, beta, epsilon), mask_index = ReduceSum(mask > 0, axis 1) as int32,
    embedding_sum = e. The Gathers read the DequantizeLinear tables, so gather_int8_rows (run after this) dequantizes
    only the gathered rows each run (onnxruntime's EmbedLayerNormalization takes float tables only: the int8 file
    keeps the table in int8, as QEmbedLayerNormalization does per tensor). Nodes whose mask_index output is read but
    that have no mask input are left alone. Returns how many nodes were rewritten."""
    from onnx import numpy_helper

    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    readers = _read_counts(graph)
    outputs = {o.name for o in graph.output}
    taken = set(inits) | set(producer) | {i.name for i in graph.input} | {i for n in graph.node for i in n.input}

    fresh = functools.partial(claim_name, taken=taken)

    def const(base: str, value: np.ndarray) -> str:
        name = fresh(base)
        graph.initializer.append(numpy_helper.from_array(value, name))
        return name

    def arg(node: onnx.NodeProto, i: int) -> str:
        return node.input[i] if i < len(node.input) else ""

    replaced: dict[int, list[onnx.NodeProto]] = {}
    for node in graph.node:
        if node.op_type != "EmbedLayerNormalization" or node.domain != "com.microsoft" or \
                not _is_int8_rows(producer.get(arg(node, 2)), inits):
            continue
        out = list(node.output) + [""] * (3 - len(node.output))
        mask = arg(node, 7)
        if out[1] and (readers[out[1]] or out[1] in outputs) and not mask:
            continue
        ids, seg_ids, word, pos, seg = arg(node, 0), arg(node, 1), arg(node, 2), arg(node, 3), arg(node, 4)
        gamma, beta, pos_ids = arg(node, 5), arg(node, 6), arg(node, 8)
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-12)
        p = node.name or fresh("embed_layer_norm")
        new: list[onnx.NodeProto] = []
        w_rows = fresh(f"{p}/word")
        new.append(helper.make_node("Gather", [word, ids], [w_rows], name=fresh(f"{p}/word_gather"), axis=0))
        if not pos_ids:
            shape, length, positions = fresh(f"{p}/shape"), fresh(f"{p}/length"), fresh(f"{p}/positions")
            new += [helper.make_node("Shape", [ids], [shape], name=fresh(f"{p}/Shape"), start=1, end=2),
                    helper.make_node("Squeeze", [shape], [length], name=fresh(f"{p}/Squeeze")),
                    helper.make_node("Cast", [length], [fresh(f"{p}/length64")], name=fresh(f"{p}/CastLength"),
                                     to=onnx.TensorProto.INT64)]
            new.append(helper.make_node("Range", [const(f"{p}/zero", np.array(0, np.int64)), new[-1].output[0],
                                                  const(f"{p}/one", np.array(1, np.int64))], [positions],
                                        name=fresh(f"{p}/Range")))
            pos_ids = positions
        p_rows = fresh(f"{p}/position")
        new.append(helper.make_node("Gather", [pos, pos_ids], [p_rows], name=fresh(f"{p}/position_gather"), axis=0))
        total = fresh(f"{p}/word_position") if (seg and seg_ids) or not out[2] else out[2]
        new.append(helper.make_node("Add", [w_rows, p_rows], [total], name=fresh(f"{p}/add_position")))
        if seg and seg_ids:
            s_rows = fresh(f"{p}/segment")
            new.append(helper.make_node("Gather", [seg, seg_ids], [s_rows], name=fresh(f"{p}/segment_gather"),
                                        axis=0))
            summed = out[2] or fresh(f"{p}/embedding_sum")
            new.append(helper.make_node("Add", [total, s_rows], [summed], name=fresh(f"{p}/add_segment")))
            total = summed
        new.append(helper.make_node("LayerNormalization", [total, gamma] + ([beta] if beta else []), [out[0]],
                                    name=node.name or fresh(f"{p}/LayerNormalization"), axis=-1, epsilon=eps))
        if out[1]:
            positive, count = fresh(f"{p}/mask_positive"), fresh(f"{p}/mask_count")
            zero = const(f"{p}/mask_zero", np.array(0, np.int32))
            mask32 = fresh(f"{p}/mask32")
            new += [helper.make_node("Cast", [mask], [mask32], name=fresh(f"{p}/CastMask"), to=onnx.TensorProto.INT32),
                    helper.make_node("Greater", [mask32, zero], [positive], name=fresh(f"{p}/Greater")),
                    helper.make_node("Cast", [positive], [count], name=fresh(f"{p}/CastCount"),
                                     to=onnx.TensorProto.INT32),
                    helper.make_node("ReduceSum", [count, const(f"{p}/axis1", np.array([1], np.int64))], [out[1]],
                                     name=fresh(f"{p}/ReduceSum"), keepdims=0)]
        replaced[id(node)] = new
    if not replaced:
        return 0
    _splice(graph, replaced, readers)
    return len(replaced)
