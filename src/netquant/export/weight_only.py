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
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from netquant.core.blockwise import BlockQuantized, WeightOnlyFormat, pack_codes
from netquant.errors import ExportError
from netquant.graph.weights import EmbeddingGather, ExternalDataReader, WeightMatMul, consumers_of

MS_DOMAIN = "com.microsoft"
EXTERNAL_THRESHOLD = 1024  # bytes: tensors at least this large go to the external-data file


def _matmulnbits_tensors(prefix: str, bq: BlockQuantized) -> tuple[list[onnx.TensorProto], list[str]]:
    spec = bq.spec
    n, kp = bq.codes.shape
    n_blocks = kp // spec.block_size
    blob = spec.block_size * spec.bits // 8
    packed = pack_codes(bq.codes, spec.bits).reshape(n, n_blocks, blob).numpy().astype(np.uint8)
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
    node = target.node
    index = list(graph.node).index(node)
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
    graph.node.remove(node)
    for offset, n in enumerate(new):
        graph.node.insert(index + offset, n)
    return tensors


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
                embeddings: Sequence[tuple[EmbeddingGather, BlockQuantized]] = ()) -> None:
    """Every target's node (codes by id(node)) and embedding Gather rewritten; float tensors nobody reads then are
    dropped."""
    inits = {t.name: t for t in model.graph.initializer}
    for t in targets:
        model.graph.initializer.extend(rewrite_weight_matmul(model, t, codes[id(t.node)], fmt, accuracy_level))
    for g, bq in embeddings:
        model.graph.initializer.extend(rewrite_embedding_gather(model, g, bq, fmt))
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

    try:
        session = ort.InferenceSession(str(staged), providers=["CPUExecutionProvider"])
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
