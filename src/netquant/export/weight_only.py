"""Weight-only files: MatMul weights as `com.microsoft.MatMulNBits` (onnxruntime) or as opset-21 blocked
DequantizeLinear -> MatMul (engines that read int4 / uint4 DQ), written with external data, validated in onnxruntime.

MatMulNBits (onnxruntime contrib op): Y = A @ W, W [K, N] given as
    B            uint8 [N, n_blocks, block_size * bits / 8]   (codes of row n, two 4-bit codes a byte, low nibble first)
    scales       float [N * n_blocks]
    zero_points  uint8 [N * ceil(n_blocks * bits / 8)]         (4-bit zero points packed the same way)
    attributes   K, N, bits, block_size, accuracy_level (0: float compute of the dequantized weights; 4: onnxruntime
                 quantizes the activations to int8 per block and runs its int8 kernels: faster, slightly less exact)
Blocked DQ (opset 21): DequantizeLinear(q [K, N] int4|uint4|int8|uint8, scale [n_blocks, N], zp, axis=0,
block_size) feeding the original MatMul (K padded codes are cut: the DQ input has exactly K rows).

Large tensors go to one external-data file beside the model (`<name>.data`), written tensor by tensor, so memory
stays near one weight tensor plus the quantized ones; both files are written to temp names and renamed at the end.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from netquant.core.blockwise import BlockQuantized, BlockSpec, WeightOnlyFormat, pack_codes
from netquant.errors import ExportError
from netquant.graph.light import remove_where
from netquant.graph.weights import EmbeddingGather, ExternalDataReader, WeightMatMul, consumers_of
from netquant.platforms.threads import apply_to_session_options

MS_DOMAIN = "com.microsoft"
EXTERNAL_THRESHOLD = 1024  # bytes: tensors at least this large go to the external-data file


def _matmulnbits_tensors(prefix: str, bq: BlockQuantized) -> tuple[list[onnx.TensorProto], list[str]]:
    spec = bq.spec
    n, kp = bq.codes.shape
    n_blocks = kp // spec.block_size
    blob = spec.block_size * spec.bits // 8
    packed = pack_codes(bq.codes, spec.bits).reshape(n, n_blocks, blob).numpy()
    tensors = [numpy_helper.from_array(packed, f"{prefix}_Q{spec.bits}"),
               numpy_helper.from_array(bq.scales.reshape(-1).numpy().astype(np.float32), f"{prefix}_scales")]
    names = [t.name for t in tensors]
    if not (spec.symmetric and bool((bq.zero_points == spec.offset).all())):
        zp = pack_codes(bq.zero_points.to(torch.uint8), spec.bits).reshape(-1).numpy().astype(np.uint8)
        tensors.append(numpy_helper.from_array(zp, f"{prefix}_zero_points"))
        names.append(tensors[-1].name)
    return tensors, names


def _blocked_dq_tensors(prefix: str, bq: BlockQuantized) -> tuple[list[onnx.TensorProto], list[str]]:
    """Codes [K, N] as uint4/uint8 (asymmetric) or int4/int8 (symmetric, zero point 0), scales [n_blocks, N]."""
    spec = bq.spec
    codes = bq.codes[:, : bq.k].t().contiguous()  # [K, N]
    zero = bq.zero_points.t().contiguous()
    if spec.symmetric and bool((bq.zero_points == spec.offset).all()):
        values = (codes.to(torch.int32) - spec.offset).numpy()
        elem = TensorProto.INT4 if spec.bits == 4 else TensorProto.INT8
        zp_values = np.zeros(tuple(zero.shape), dtype=np.int32)
    else:
        values = codes.to(torch.int32).numpy()
        elem = TensorProto.UINT4 if spec.bits == 4 else TensorProto.UINT8
        zp_values = zero.numpy().astype(np.int32)
    q = _int_tensor(f"{prefix}_q", elem, values)
    s = numpy_helper.from_array(bq.scales.t().contiguous().numpy().astype(np.float32), f"{prefix}_scale")
    zp = _int_tensor(f"{prefix}_zp", elem, zp_values)
    return [q, s, zp], [q.name, s.name, zp.name]


def _int_tensor(name: str, elem: int, values: np.ndarray) -> onnx.TensorProto:
    """An integer initializer from int values, 4-bit ones packed two a byte (low nibble first) as raw data."""
    flat = values.reshape(-1).astype(np.int32)
    if elem in (TensorProto.INT4, TensorProto.UINT4):
        nib = (flat & 0x0F).astype(np.uint8)
        if nib.size % 2:
            nib = np.append(nib, np.uint8(0))
        raw = (nib[0::2] | (nib[1::2] << 4)).astype(np.uint8).tobytes()
    else:
        raw = flat.astype(np.int8 if elem == TensorProto.INT8 else np.uint8).tobytes()
    return helper.make_tensor(name, elem, list(values.shape), raw, raw=True)


def rewrite_weight_matmul(model: onnx.ModelProto, target: WeightMatMul, bq: BlockQuantized,
                          fmt: WeightOnlyFormat, accuracy_level: int = 0) -> list[onnx.TensorProto]:
    """Replace `target`'s node by the weight-only form of `bq` (in place); returns the new initializers."""
    graph = model.graph
    index = list(graph.node).index(target.node)
    new, tensors = weight_matmul_nodes(target, bq, fmt, accuracy_level)
    graph.node.remove(target.node)
    for offset, n in enumerate(new):
        graph.node.insert(index + offset, n)
    return tensors


def _splice(graph: onnx.GraphProto, replace: dict[int, list[onnx.NodeProto]]) -> None:
    """Each node whose id is in `replace` swapped for its list of nodes, in one rebuild of the node list (earlier
    references to the graph's nodes go stale: call it last)."""
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        nodes.extend(replace.get(id(node), [node]))
    copies = [onnx.NodeProto() for _ in nodes]
    for copy, node in zip(copies, nodes, strict=True):
        copy.CopyFrom(node)
    del graph.node[:]
    graph.node.extend(copies)


def weight_matmul_nodes(target: WeightMatMul, bq: BlockQuantized, fmt: WeightOnlyFormat, accuracy_level: int = 0
                        ) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes replacing `target`'s node in the weight-only form of `bq`, and their new initializers."""
    node = target.node
    prefix = target.weight
    if fmt is WeightOnlyFormat.MATMUL_NBITS:
        tensors, names = _matmulnbits_tensors(prefix, bq)
        inputs = [target.activation, names[0], names[1], names[2] if len(names) > 2 else ""]
        if target.bias:
            inputs += ["", target.bias]  # g_idx omitted, bias
        while inputs and inputs[-1] == "":
            inputs.pop()
        new = [helper.make_node("MatMulNBits", inputs, list(node.output), name=node.name or f"{prefix}_MatMulNBits",
                                domain=MS_DOMAIN, K=target.k, N=target.n, bits=bq.spec.bits,
                                block_size=bq.spec.block_size, accuracy_level=accuracy_level)]
    else:
        tensors, names = _blocked_dq_tensors(prefix, bq)
        w = f"{prefix}_dq"
        new = [helper.make_node("DequantizeLinear", names, [w], name=f"{prefix}_DequantizeLinear", axis=0,
                                block_size=bq.spec.block_size)]
        if target.bias:
            mm = f"{prefix}_matmul"
            new += [helper.make_node("MatMul", [target.activation, w], [mm], name=node.name or f"{prefix}_MatMul"),
                    helper.make_node("Add", [mm, target.bias], list(node.output), name=f"{prefix}_bias")]
        else:
            new += [helper.make_node("MatMul", [target.activation, w], list(node.output),
                                     name=node.name or f"{prefix}_MatMul")]
    return new, tensors


def rewrite_embedding_gather(model: onnx.ModelProto, target: EmbeddingGather, bq: BlockQuantized,
                             fmt: WeightOnlyFormat) -> list[onnx.TensorProto]:
    """Replace the Gather by com.microsoft.GatherBlockQuantized (rows of codes [V, D] in blocks along D; onnxruntime) or
    by blocked DequantizeLinear(axis 1) -> Gather (opset 21). `bq` holds the table's rows: quantize `table.T`."""
    graph = model.graph
    node = target.node
    index = list(graph.node).index(node)
    prefix = target.table
    spec = bq.spec
    if fmt is WeightOnlyFormat.MATMUL_NBITS:
        data = pack_codes(bq.codes[:, : target.dim], spec.bits).numpy().astype(np.uint8)
        zp = pack_codes(bq.zero_points.to(torch.uint8), spec.bits).numpy().astype(np.uint8)
        tensors = [numpy_helper.from_array(data, f"{prefix}_Q{spec.bits}"),
                   numpy_helper.from_array(bq.scales.numpy().astype(np.float32), f"{prefix}_scales"),
                   numpy_helper.from_array(zp, f"{prefix}_zero_points")]
        new = [helper.make_node("GatherBlockQuantized", [tensors[0].name, node.input[1], tensors[1].name,
                                                         tensors[2].name], list(node.output),
                                name=node.name or f"{prefix}_GatherBlockQuantized", domain=MS_DOMAIN, gather_axis=0,
                                quantize_axis=1, block_size=spec.block_size, bits=spec.bits)]
    else:
        # the rows as a [D, V] weight: _blocked_dq_tensors gives codes [D, V] with blocks along D; transpose back
        codes_kn, names = _blocked_dq_tensors(prefix, bq)
        q = numpy_helper.to_array(codes_kn[0]).T.copy()
        zp = numpy_helper.to_array(codes_kn[2]).T.copy()
        elem = codes_kn[0].data_type
        tensors = [_int_tensor(names[0], elem, q), numpy_helper.from_array(bq.scales.numpy().astype(np.float32),
                                                                          names[1]), _int_tensor(names[2], elem, zp)]
        table = f"{prefix}_dq"
        new = [helper.make_node("DequantizeLinear", names, [table], name=f"{prefix}_DequantizeLinear", axis=1,
                                block_size=spec.block_size),
               helper.make_node("Gather", [table, node.input[1]], list(node.output), name=node.name or f"{prefix}_Gather",
                                axis=0)]
    graph.node.remove(node)
    for offset, n in enumerate(new):
        graph.node.insert(index + offset, n)
    return tensors


def ensure_opsets(model: onnx.ModelProto, fmt: WeightOnlyFormat) -> None:
    """MatMulNBits needs the com.microsoft domain; blocked DQ needs ai.onnx opset >= 21 (the model must have been
    converted with `export.opset.upgrade_opset` before; this only checks)."""
    domains = {o.domain: o for o in model.opset_import}
    if fmt is WeightOnlyFormat.MATMUL_NBITS:
        if MS_DOMAIN not in domains:
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    else:
        default = domains.get("") or domains.get("ai.onnx")
        if default is None or default.version < 21:
            raise ExportError("blocked DequantizeLinear needs ai.onnx opset 21; upgrade the model first")
        model.ir_version = max(model.ir_version, 10)


def save_with_external_data(model: onnx.ModelProto, path: Path, reader: ExternalDataReader,
                            check: Callable[[Path], None] | None = None) -> list[Path]:
    """Write `model` to `path` and its tensors >= EXTERNAL_THRESHOLD bytes to `<path.name>.data`, both whole or not at
    all: they are staged in a hidden folder beside `path`, `check(staged model path)` runs there (validation), then
    both are renamed into place. Initializers still external in the source are copied in chunks."""
    data_path = path.with_name(path.name + ".data")
    folder = path.parent
    if not folder.is_dir():
        raise ExportError(f"cannot write '{path}': folder '{folder}' does not exist")
    for target in (path, data_path):
        if target.is_dir():
            raise ExportError(f"cannot write '{target}': it is a folder; give a file name")
    try:
        stage = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=folder))
    except OSError as exc:
        raise ExportError(f"cannot write '{path}': folder '{folder}' refuses new files ({exc.strerror})") from exc
    tmp_model, tmp_data = stage / path.name, stage / data_path.name
    try:
        offset = 0
        with open(tmp_data, "wb") as out:
            for tensor in model.graph.initializer:
                if _tensor_nbytes(tensor) < EXTERNAL_THRESHOLD:
                    continue
                pad = (-offset) % 64
                out.write(b"\0" * pad)
                offset += pad
                written = 0
                external = tensor.data_location == TensorProto.EXTERNAL
                for chunk in reader.raw_bytes(tensor) if external else [_raw(tensor)]:
                    out.write(chunk)
                    written += len(chunk)
                _set_external(tensor, data_path.name, offset, written)
                offset += written
        onnx.save_model(model, str(tmp_model))
        if check is not None:
            check(tmp_model)
        os.replace(tmp_data, data_path)
        os.replace(tmp_model, path)
    except OSError as exc:
        raise ExportError(f"writing '{path}' failed, nothing written: {exc}") from exc
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return [path, data_path]


def _raw(tensor: onnx.TensorProto) -> bytes:
    if tensor.HasField("raw_data"):
        return tensor.raw_data
    return numpy_helper.to_array(tensor).tobytes()


def _tensor_nbytes(tensor: onnx.TensorProto) -> int:
    if tensor.data_location == TensorProto.EXTERNAL:
        return EXTERNAL_THRESHOLD
    if tensor.HasField("raw_data"):
        return len(tensor.raw_data)
    return len(_raw(tensor))


def _set_external(tensor: onnx.TensorProto, location: str, offset: int, length: int) -> None:
    tensor.ClearField("raw_data")
    for field in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data", "string_data"):
        tensor.ClearField(field)
    del tensor.external_data[:]
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def rewrite_all(model: onnx.ModelProto, targets: Sequence[WeightMatMul], codes: dict[int, BlockQuantized],
                fmt: WeightOnlyFormat, accuracy_level: int = 0,
                embeddings: Sequence[tuple[EmbeddingGather, BlockQuantized]] = (),
                wide_level: int | None = None) -> None:
    """Every target's node (codes by id(node)) and embedding Gather rewritten; float tensors nobody reads then are
    dropped. `wide_level`: the accuracy_level of 8-bit MatMulNBits layers in an int4 model (lm_head at head_bits=8,
    mixed int8 layers): onnxruntime's 8-bit float path (level 0) dequantizes the whole weight every call, 2.4 s vs
    59 ms (4-bit) for a 2048 x 32000 lm_head on one thread; level 4 (int8 activations) takes 23 ms."""
    inits = {t.name: t for t in model.graph.initializer}
    for g, bq in embeddings:
        model.graph.initializer.extend(rewrite_embedding_gather(model, g, bq, fmt))
    replace: dict[int, list[onnx.NodeProto]] = {}
    for t in targets:
        bq = codes[id(t.node)]
        level = max(accuracy_level, wide_level) if wide_level is not None and bq.spec.bits == 8 else accuracy_level
        replace[id(t.node)], tensors = weight_matmul_nodes(t, bq, fmt, level)
        model.graph.initializer.extend(tensors)
    _splice(model.graph, replace)  # one rebuild of the node list, not a search and an insert per target
    read = consumers_of(model)
    outputs = {o.name for o in model.graph.output}
    for name in {t.weight for t in targets} | {g.table for g, _ in embeddings}:
        if name not in read and name not in outputs and name in inits:
            model.graph.initializer.remove(inits[name])


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """cos(a, b) over all elements in float64 (1 for two all-zero arrays, 0 for one)."""
    x, y = a.astype(np.float64).reshape(-1), b.astype(np.float64).reshape(-1)
    den = np.linalg.norm(x) * np.linalg.norm(y)
    return float(x @ y / den) if den > 0 else float(np.array_equal(x, y))


def engine_cosines(staged: Path, names: Sequence[str], feeds: Sequence[dict[str, np.ndarray]],
                   reference: Sequence[Sequence[np.ndarray]]) -> dict[str, float]:
    """onnxruntime runs the file; per output the lowest cosine vs the FP32 `reference` over the feeds. A file
    onnxruntime cannot run, or with non-finite outputs, is an ExportError."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    apply_to_session_options(opts)  # the thread_scope's threads, if any
    try:
        session = ort.InferenceSession(str(staged), opts, providers=["CPUExecutionProvider"])
        outputs = [session.run(list(names), feed) for feed in feeds]
    except Exception as exc:
        raise ExportError(f"the weight-only file failed in onnxruntime, nothing written: {type(exc).__name__}: "
                          f"{exc}") from exc
    cos: dict[str, float] = {}
    for got_all, ref in zip(outputs, reference, strict=True):
        for name, got, want in zip(names, got_all, ref, strict=True):
            if not np.isfinite(got).all():
                raise ExportError(f"weight-only file: output '{name}' is not finite in onnxruntime; nothing written. "
                                  "Try 8 bits or exclude the layers that feed it")
            cos[name] = min(cos.get(name, 1.0), cosine(got, want))
    return cos


def write_weight_only(model: onnx.ModelProto, path: Path, reader: ExternalDataReader, fmt: WeightOnlyFormat,
                      feeds: Sequence[dict[str, np.ndarray]], reference: Sequence[Sequence[np.ndarray]]
                      ) -> tuple[list[Path], dict[str, float]]:
    """Save the rewritten `model` with external data, validated in onnxruntime against `reference` before it is
    moved into place; (files written, per-output cosine vs FP32)."""
    ensure_opsets(model, fmt)
    names = [o.name for o in model.graph.output]
    cos: dict[str, float] = {}

    def check(staged: Path) -> None:
        cos.update(engine_cosines(staged, names, feeds, reference))

    return save_with_external_data(model, path, reader, check), cos


def model_bytes(path: Path) -> int:
    """A model file's size plus its external data files'."""
    model = onnx.load_model(str(path), load_external_data=False)
    total = path.stat().st_size
    seen = set()
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            loc = {e.key: e.value for e in t.external_data}["location"]
            if loc not in seen:
                seen.add(loc)
                total += (path.parent / loc).stat().st_size
    return total


_DQ_BITS = {TensorProto.INT4: (4, True), TensorProto.UINT4: (4, False), TensorProto.INT8: (8, True),
            TensorProto.UINT8: (8, False)}


@dataclass
class _DqWeight:
    """A blocked DequantizeLinear of a constant integer weight feeding one MatMul / Gemm as its B (maybe through a
    2-D Transpose): the nodes to drop and the weight's [N, K] integer codes, scales and zero points."""

    dq: onnx.NodeProto
    transpose: onnx.NodeProto | None
    consumer: onnx.NodeProto
    q_nk: np.ndarray
    scale_nk: np.ndarray
    zero_nk: np.ndarray | None
    bits: int
    signed: bool
    block_size: int


def _find_dq_weight(node: onnx.NodeProto, inits: dict[str, onnx.TensorProto],
                    consumers: dict[str, list[onnx.NodeProto]], outputs: set[str]) -> _DqWeight | None:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    block = int(attrs.get("block_size", 0))
    q_t = inits.get(node.input[0])
    if q_t is None or q_t.data_type not in _DQ_BITS or len(q_t.dims) != 2 or block < 16 or block & (block - 1):
        return None
    if len(node.input) < 2 or node.input[1] not in inits or (len(node.input) > 2 and node.input[2]
                                                              and node.input[2] not in inits):
        return None
    axis = int(attrs.get("axis", 1)) % 2
    users = consumers.get(node.output[0], [])
    if len(users) != 1 or node.output[0] in outputs:
        return None
    user, transpose = users[0], None
    w_axis_k = 0  # the axis of the B operand that is K
    if user.op_type == "Transpose":
        perm = [a.ints for a in user.attribute if a.name == "perm"]
        nxt = consumers.get(user.output[0], [])
        if (perm and list(perm[0]) != [1, 0]) or len(nxt) != 1 or user.output[0] in outputs:
            return None
        transpose, user, w_axis_k = user, nxt[0], 1
    if user.domain not in ("", "ai.onnx") or len(user.input) < 2 or user.input[1] != (transpose or node).output[0]:
        return None
    if user.op_type == "Gemm":
        g = {a.name: helper.get_attribute_value(a) for a in user.attribute}
        if g.get("transA", 0) or g.get("alpha", 1.0) != 1.0 or g.get("beta", 1.0) != 1.0:
            return None
        if g.get("transB", 0):
            w_axis_k = 1 - w_axis_k
    elif user.op_type != "MatMul":
        return None
    if axis != w_axis_k:  # blocks must run along K
        return None
    q = numpy_helper.to_array(q_t).astype(np.int32)
    scale = numpy_helper.to_array(inits[node.input[1]]).astype(np.float32)
    zero = numpy_helper.to_array(inits[node.input[2]]).astype(np.int32) if len(node.input) > 2 and node.input[2] \
        else None
    if scale.dtype != np.float32 or inits[node.input[1]].data_type != TensorProto.FLOAT:
        return None
    if axis == 0:  # stored [K, N]
        q, scale = q.T, scale.T
        zero = None if zero is None else zero.T
    bits, signed = _DQ_BITS[q_t.data_type]
    return _DqWeight(node, transpose, user, np.ascontiguousarray(q), np.ascontiguousarray(scale),
                     None if zero is None else np.ascontiguousarray(zero), bits, signed, block)


def _block_quantized(w: _DqWeight) -> BlockQuantized:
    """The DQ weight as MatMulNBits codes: unsigned codes (signed ones shifted by 2^(bits-1)), K padded to whole
    blocks with each row's last zero point (padding dequantizes to 0)."""
    n, k = w.q_nk.shape
    offset = 1 << (w.bits - 1) if w.signed else 0
    zero = np.zeros_like(w.scale_nk, dtype=np.int32) if w.zero_nk is None else w.zero_nk
    codes = w.q_nk + offset
    zp = zero + offset
    pad = (-k) % w.block_size
    if pad:
        codes = np.concatenate([codes, np.repeat(zp[:, -1:], pad, axis=1)], axis=1)
    symmetric = w.signed and bool((zero == 0).all())
    spec = BlockSpec(w.bits, w.block_size, symmetric)
    return BlockQuantized(torch.from_numpy(codes.astype(np.uint8)), torch.from_numpy(w.scale_nk),
                          torch.from_numpy(zp.astype(np.int32)), k, spec)


def dq_weights_to_matmulnbits(model: onnx.ModelProto, accuracy_level: int = 0) -> int:
    """Rewrite, in place, every blocked DequantizeLinear (int4 / uint4 / int8 / uint8 initializer, block 16..,
    blocks along K) feeding one MatMul / Gemm as B (directly or through Transpose(perm=[1, 0])) into a
    com.microsoft.MatMulNBits (`accuracy_level`: 0 float compute, 4 int8 activations); returns how many.
    Initializers nobody reads any more are dropped."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    consumers = consumers_of(model)
    outputs = {o.name for o in graph.output}
    found = [w for node in list(graph.node) if node.op_type == "DequantizeLinear" and node.domain in ("", "ai.onnx")
             for w in [_find_dq_weight(node, inits, consumers, outputs)] if w is not None]
    dropped: set[str] = set()
    for w in found:
        bq = _block_quantized(w)
        n, k = w.q_nk.shape
        bias = w.consumer.input[2] if w.consumer.op_type == "Gemm" and len(w.consumer.input) > 2 else ""
        add = _bias_add(w.consumer, n, inits, consumers, outputs) if w.consumer.op_type == "MatMul" else None
        if add is not None:  # MatMul -> Add(bias [N]) becomes MatMulNBits' bias input
            bias = next(i for i in add.input if i != w.consumer.output[0])
            w.consumer.output[0] = add.output[0]
            graph.node.remove(add)
        target = WeightMatMul(w.consumer, w.consumer.input[0], w.dq.input[0], k, n, bias=bias)
        graph.initializer.extend(rewrite_weight_matmul(model, target, bq, WeightOnlyFormat.MATMUL_NBITS,
                                                      accuracy_level))
        for node in (w.dq, w.transpose):
            if node is not None:
                graph.node.remove(node)
        dropped.update(w.dq.input)
    if found:
        used = _used_names(graph) | outputs
        remove_where(graph.initializer, lambda t: t.name in dropped and t.name not in used)
        ensure_opsets(model, WeightOnlyFormat.MATMUL_NBITS)
    return len(found)


def _bias_add(matmul: onnx.NodeProto, n: int, inits: dict[str, onnx.TensorProto],
              consumers: dict[str, list[onnx.NodeProto]], outputs: set[str]) -> onnx.NodeProto | None:
    """The Add that is the only reader of `matmul`'s output and adds a float [N] initializer, if there is one."""
    users = consumers.get(matmul.output[0], [])
    if len(users) != 1 or matmul.output[0] in outputs:
        return None
    add = users[0]
    if add.op_type != "Add" or add.domain not in ("", "ai.onnx") or len(add.input) != 2:
        return None
    other = add.input[1] if add.input[0] == matmul.output[0] else add.input[0]
    t = inits.get(other)
    if other == matmul.output[0] or t is None or t.data_type != TensorProto.FLOAT or list(t.dims) != [n]:
        return None
    return add


def _used_names(graph: onnx.GraphProto) -> set[str]:
    """Every tensor name a node of `graph` or of its subgraphs reads."""
    used: set[str] = set()
    for node in graph.node:
        used.update(node.input)
        for attr in node.attribute:
            for sub in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                used |= _used_names(sub)
    return used
