"""Weight-only quantization of an ONNX model's MatMul / Gemm weights (int4 / int8, block-wise): the whole flow.

    1. find the weight MatMuls (`export.weight_only.find_weight_matmuls`), minus `exclude` patterns (node or weight
       names, `core.selectors` language);
    2. for data-aware algorithms, run the FP32 model in onnxruntime with every weight MatMul's input exposed and
       accumulate `calib.input_stats.InputStatistics` per activation (Hessian for GPTQ, samples for AWQ);
    3. quantize each weight: RTN, HQQ, AWQ (per activation: the MatMuls reading it share one channel scale, folded into
       a LayerNormalization-style producer's scale when the activation feeds only them, else an explicit Mul) or GPTQ;
    4. rewrite the nodes (MatMulNBits or blocked DQ) and stream the result to disk with external data;
    5. validate: onnxruntime loads the file and runs the calibration feeds; outputs are compared with FP32.
The source model is never loaded whole: weights are read one at a time from their external data (memory-mapped).
"""

from __future__ import annotations

import enum
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from netquant.calib.input_stats import InputStatistics
from netquant.core.awq import awq_search
from netquant.core.blockwise import (
    BlockQuantized,
    BlockSpec,
    quantize_hqq,
    quantize_rtn,
)
from netquant.core.gptq import quantize_gptq
from netquant.core.selectors import NamePattern
from netquant.data.tokens import validation_feeds
from netquant.errors import ConfigError, DataError, ExportError, ModelError
from netquant.export.opset import upgrade_opset
from netquant.export.weight_only import (
    ExternalDataReader,
    WeightMatMul,
    WeightOnlyFormat,
    ensure_opsets,
    find_embedding_gathers,
    find_weight_matmuls,
    rewrite_embedding_gather,
    rewrite_weight_matmul,
    save_with_external_data,
)

Feeds = dict[str, np.ndarray]
_NORM_SCALE_INPUT = {("", "LayerNormalization"): (1, 2), ("", "SimplifiedLayerNormalization"): (1, None),
                     ("com.microsoft", "SimplifiedLayerNormalization"): (1, None),
                     ("com.microsoft", "SkipSimplifiedLayerNormalization"): (2, None),
                     ("com.microsoft", "SkipLayerNormalization"): (2, 3), ("", "RMSNormalization"): (1, None)}


class WeightAlgorithm(enum.Enum):
    """How block codes are chosen."""

    RTN = "rtn"    # round to nearest, block min / max
    HQQ = "hqq"    # clip search + half-quadratic scale / zero refinement (no data)
    AWQ = "awq"    # activation-aware channel scaling + clip search weighted by activations
    GPTQ = "gptq"  # Hessian-based error compensation

    @property
    def needs_data(self) -> bool:
        return self in (WeightAlgorithm.AWQ, WeightAlgorithm.GPTQ)


@dataclass(frozen=True)
class WeightOnlyConfig:
    bits: int = 4
    block_size: int = 128
    symmetric: bool = True
    algorithm: WeightAlgorithm = WeightAlgorithm.RTN
    fmt: WeightOnlyFormat = WeightOnlyFormat.MATMUL_NBITS
    act_order: bool = False
    exclude: tuple[str, ...] = ()
    max_loss: float | None = None  # mixed int4 / int8 within this output loss (1 - cosine vs FP32); None: all `bits`
    accuracy_level: int = 0  # MatMulNBits: 0 float compute, 4 int8 activations (onnxruntime's fast int8 kernels)
    embeddings: bool = False  # also the Gather tables (token embeddings): GatherBlockQuantized / blocked DQ + Gather

    def __post_init__(self) -> None:
        if self.max_loss is not None and (not math.isfinite(self.max_loss) or not 0 <= self.max_loss < 1):
            raise ConfigError(f"weight-only max_loss={self.max_loss}: give a number in [0, 1), e.g. 0.01")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ConfigError(f"weight-only accuracy_level={self.accuracy_level}: use 0 (float) .. 4 (int8 activations)")
        if self.max_loss is not None and self.bits != 4:
            raise ConfigError("weight-only max_loss mixes int4 and int8 layers: use it with bits=4")

    @property
    def spec(self) -> BlockSpec:
        return BlockSpec(self.bits, self.block_size, self.symmetric)


@dataclass
class LayerRecord:
    """What happened to one weight: its node, shape, algorithm details and weight / output error."""

    node: str
    weight: str
    k: int
    n: int
    weight_mse: float
    awq_alpha: float | None = None
    bits: int = 4
    sensitivity: float | None = None


@dataclass
class WeightOnlyResult:
    path: Path
    files: list[Path]
    layers: list[LayerRecord]
    skipped: list[str]
    cosine: dict[str, float] = field(default_factory=dict)
    source_bytes: int = 0
    output_bytes: int = 0
    seconds: float = 0.0
    mixed: MixedSearch | None = None


def _excluded(target: WeightMatMul, patterns: list[NamePattern]) -> bool:
    return any(p.matches(target.node.name) or p.matches(target.weight) for p in patterns)


class _Session:
    """onnxruntime on a model proto (without its weights) whose external data lives in `base_dir`; `outputs` adds
    intermediate tensors as outputs."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path, outputs: Sequence[str] = ()) -> None:
        import onnxruntime as ort

        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        known = {o.name for o in probe.graph.output}
        for name in outputs:
            if name not in known:
                probe.graph.output.append(helper.make_empty_tensor_value_info(name))
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(base_dir))
        self.session = ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"])

    def run(self, names: Sequence[str], feeds: Feeds) -> list[np.ndarray]:
        return self.session.run(list(names), feeds)

    def close(self) -> None:
        del self.session


def collect_input_statistics(model: onnx.ModelProto, base_dir: Path, targets: list[WeightMatMul],
                             feeds: Sequence[Feeds], with_hessian: bool,
                             progress: Callable[[str], None] | None = None) -> dict[str, InputStatistics]:
    """Per activation read by a target, its InputStatistics over the calibration feeds (FP32, onnxruntime)."""
    acts = list(dict.fromkeys(t.activation for t in targets))
    k_of = {t.activation: t.k for t in targets}
    stats = {a: InputStatistics(k_of[a], with_hessian=with_hessian) for a in acts}
    session = _Session(model, base_dir, acts)
    try:
        for i, feed in enumerate(feeds):
            for name, value in zip(acts, session.run(acts, feed), strict=True):
                stats[name].observe(torch.from_numpy(np.asarray(value, dtype=np.float32)), name)
            if progress:
                progress(f"calibration batch {i + 1}/{len(feeds)}")
    finally:
        session.close()
    return stats


def _weight_kn(reader: ExternalDataReader, tensor: onnx.TensorProto, target: WeightMatMul) -> torch.Tensor:
    w = torch.from_numpy(np.array(reader.array(tensor), dtype=np.float32))
    if not torch.isfinite(w).all():
        raise DataError(f"weight '{target.weight}' of node '{target.node.name}' holds NaN or Inf; fix the model "
                        "or exclude the node (exclude=['name:...'])")
    return w.t() if target.transposed else w


def _fold_or_mul(model: onnx.ModelProto, reader: ExternalDataReader, activation: str, group: list[WeightMatMul],
                 inv_scale: np.ndarray, consumers: dict[str, list[onnx.NodeProto]]) -> None:
    """Make the group's MatMuls read activation / s: fold 1/s into the producer's norm scale (and bias) when the
    activation feeds only the group and the scale initializer only that node; else insert Mul(activation, 1/s)."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = next((n for n in graph.node if activation in n.output), None)
    group_nodes = {id(t.node) for t in group}
    only_group = all(id(c) in group_nodes for c in consumers.get(activation, []))
    key = (producer.domain if producer is not None else None, producer.op_type if producer is not None else None)
    if producer is not None and only_group and key in _NORM_SCALE_INPUT and producer.output[0] == activation \
            and not any(o.name == activation for o in graph.output):
        scale_idx, bias_idx = _NORM_SCALE_INPUT[key]
        names = [producer.input[i] for i in (scale_idx, bias_idx) if i is not None and i < len(producer.input)
                 and producer.input[i]]
        if all(n in inits and len(consumers.get(n, [])) == 1 for n in names):
            for name in names:
                t = inits[name]
                value = reader.array(t).astype(np.float32) * inv_scale
                t.CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))
            return
    if producer is not None and only_group and key == ("", "Mul") and producer.output[0] == activation \
            and not any(o.name == activation for o in graph.output):
        for name in producer.input:
            t = inits.get(name)
            if t is not None and list(t.dims)[-1:] == [len(inv_scale)] and len(consumers.get(name, [])) == 1:
                value = reader.array(t).astype(np.float32) * inv_scale
                t.CopyFrom(numpy_helper.from_array(value.astype(np.float32), name))
                return
    scale_name = f"{activation}_awq_inv_scale"
    scaled = f"{activation}_awq"
    graph.initializer.append(numpy_helper.from_array(inv_scale.astype(np.float32), scale_name))
    mul = helper.make_node("Mul", [activation, scale_name], [scaled], name=f"{activation}_awq_Mul")
    first = min(list(graph.node).index(t.node) for t in group)
    graph.node.insert(first, mul)
    for t in group:
        t.node.input[0] = scaled
        t.activation = scaled


def _fold_into_producer_columns(model: onnx.ModelProto, activation: str, group: list[WeightMatMul],
                                inv_scale: np.ndarray, consumers: dict[str, list[onnx.NodeProto]],
                                by_output: dict[str, WeightMatMul], overrides: dict[str, torch.Tensor],
                                load: Callable[[WeightMatMul], torch.Tensor]) -> bool:
    """activation = a * b (a Mul) with b the output of a not-yet-quantized weight MatMul that feeds only this Mul: scale
    that MatMul's output columns by 1/s (AWQ's fold of down_proj's scale into up_proj). True when folded."""
    producer = next((n for n in model.graph.node if activation in n.output), None)
    group_nodes = {id(t.node) for t in group}
    if producer is None or producer.op_type != "Mul" or producer.domain not in ("", "ai.onnx") or \
            not all(id(c) in group_nodes for c in consumers.get(activation, [])) or \
            any(o.name == activation for o in model.graph.output):
        return False
    for name in producer.input:
        source = by_output.get(name)
        if source is None or len(consumers.get(name, [])) != 1 or len(consumers.get(source.weight, [])) != 1 \
                or source.weight in overrides or source.activation == activation:
            continue
        overrides[source.weight] = load(source) * torch.from_numpy(inv_scale).unsqueeze(0)
        return True
    return False


def _consumers(model: onnx.ModelProto) -> dict[str, list[onnx.NodeProto]]:
    out: dict[str, list[onnx.NodeProto]] = {}
    for node in model.graph.node:
        for name in node.input:
            if name:
                out.setdefault(name, []).append(node)
    return out


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    x, y = a.astype(np.float64).reshape(-1), b.astype(np.float64).reshape(-1)
    den = np.linalg.norm(x) * np.linalg.norm(y)
    return float(x @ y / den) if den > 0 else float(np.array_equal(x, y))


def quantize_weights_onnx(model_path: str | os.PathLike[str], output: str | os.PathLike[str],
                          config: WeightOnlyConfig, feeds: Sequence[Feeds] = (),
                          progress: Callable[[str], None] | None = None) -> WeightOnlyResult:
    """Weight-only quantize `model_path` into `output` (module docstring). `feeds`: calibration inputs by name (needed
    by AWQ / GPTQ and max_loss, used for validation by all; without them the file is validated on random inputs)."""
    start = time.perf_counter()
    src = Path(model_path).resolve()
    out = Path(output).resolve()
    if not src.is_file():
        raise ModelError(f"model '{model_path}' does not exist")
    if out == src or out.with_name(out.name + ".data") == src:
        raise ConfigError(f"output '{output}' is the input model; choose another path (inputs are never overwritten)")
    if (config.algorithm.needs_data or config.max_loss is not None) and not feeds:
        what = "mixed int4 / int8 (max_loss)" if config.max_loss is not None else config.algorithm.value
        raise DataError(f"weight-only {what} needs calibration data; give feeds / --calib, or use algorithm rtn or "
                        "hqq without max_loss")
    try:
        model = onnx.load_model(str(src), load_external_data=False)
    except Exception as exc:
        raise ModelError(f"model '{src}' cannot be read as ONNX ({type(exc).__name__}: {exc})") from exc
    if config.fmt is WeightOnlyFormat.BLOCKED_DQ:
        model = upgrade_opset(model, 21)
    reader = ExternalDataReader(src.parent)
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            loc = {e.key: e.value for e in t.external_data}.get("location", "")
            if (src.parent / loc).resolve() in (out, out.with_name(out.name + ".data")):
                raise ConfigError(f"output '{output}' would overwrite the model's external data '{loc}'; choose "
                                  "another name")
    patterns = [NamePattern.parse(p) for p in config.exclude]
    all_targets = find_weight_matmuls(model)
    targets = [t for t in all_targets if not _excluded(t, patterns)]
    skipped = [t.node.name for t in all_targets if _excluded(t, patterns)]
    if not targets:
        raise ModelError(f"model '{src}' has no MatMul / Gemm with a constant 2-D float weight (K >= 16) to quantize"
                         + (f" outside the excluded {list(config.exclude)}" if skipped else ""))
    spec = config.spec
    output_names = [o.name for o in model.graph.output]
    if not feeds:  # no calibration data: the file is still run and compared with FP32 on random inputs
        feeds = validation_feeds(model)
    reference: list[list[np.ndarray]] = []
    stats: dict[str, InputStatistics] = {}
    if feeds:
        if config.algorithm.needs_data or config.max_loss is not None:
            stats = collect_input_statistics(model, src.parent, targets, feeds,
                                             config.algorithm is WeightAlgorithm.GPTQ, progress)
        session = _Session(model, src.parent)
        try:
            reference = [session.run(output_names, f) for f in feeds[:4]]
        finally:
            session.close()
    inits = {t.name: t for t in model.graph.initializer}
    consumers = _consumers(model)
    records: list[LayerRecord] = []
    quantized: dict[int, tuple[BlockQuantized, float, torch.Tensor]] = {}
    overrides: dict[str, torch.Tensor] = {}  # weights [K, N] changed before quantization (AWQ folds)
    if config.algorithm is WeightAlgorithm.AWQ:
        groups: dict[str, list[WeightMatMul]] = {}
        for t in targets:
            groups.setdefault(t.activation, []).append(t)
        # last group first: a group's 1/s may fold into the columns of an earlier target (up_proj before down_proj)
        for act, group in reversed(list(groups.items())):
            weights = [overrides[t.weight] if t.weight in overrides else _weight_kn(reader, inits[t.weight], t)
                       for t in group]
            result = awq_search(stats[act].sample_rows(), weights, spec)
            for t, bq in zip(group, result.quantized, strict=True):
                quantized[id(t.node)] = (bq, result.alpha, result.scale)
            del weights
            if result.alpha > 0:
                inv = (1.0 / result.scale).numpy()
                by_output = {t.node.output[0]: t for t in targets if not t.bias and id(t.node) not in quantized}
                if not _fold_into_producer_columns(model, act, group, inv, consumers, by_output, overrides,
                                                   lambda t: _weight_kn(reader, inits[t.weight], t)):
                    _fold_or_mul(model, reader, act, group, inv, consumers)
            if progress:
                progress(f"awq {act}: alpha {result.alpha:.2f}")
    chosen: dict[int, BlockQuantized] = {}
    wide: dict[int, BlockQuantized] = {}
    spec8 = BlockSpec(8, spec.block_size, spec.symmetric)
    for i, t in enumerate(targets):
        w = overrides.pop(t.weight) if t.weight in overrides else _weight_kn(reader, inits[t.weight], t)
        if id(t.node) in quantized:
            bq, awq_alpha, awq_scale = quantized.pop(id(t.node))
            alpha: float | None = awq_alpha
            w_eff = w * awq_scale.unsqueeze(1)
            mse = float(((bq.dequantize() / awq_scale.unsqueeze(1) - w) ** 2).mean())
        else:
            alpha, w_eff = None, w
            if config.algorithm is WeightAlgorithm.GPTQ:
                bq = quantize_gptq(w, stats[t.activation].hessian(t.activation), spec, act_order=config.act_order,
                                   name=t.weight)
            elif config.algorithm is WeightAlgorithm.HQQ:
                bq = quantize_hqq(w, spec)
            else:
                bq = quantize_rtn(w, spec)
            mse = float(((bq.dequantize() - w) ** 2).mean())
        chosen[id(t.node)] = bq
        record = LayerRecord(t.node.name, t.weight, t.k, t.n, mse, alpha, bits=config.bits)
        if config.max_loss is not None:
            wide[id(t.node)] = quantize_rtn(w_eff, spec8)
            rows = stats[t.activation].sample_rows()
            ref = rows @ w_eff
            record.sensitivity = float(((rows @ bq.dequantize() - ref) ** 2).sum() / (ref * ref).sum().clamp_min(1e-30))
        records.append(record)
        if progress:
            progress(f"quantized {i + 1}/{len(targets)}: {t.node.name or t.weight}")
    search: MixedSearch | None = None
    if config.max_loss is not None:
        search = _mixed_search(model, src.parent, targets, records, chosen, wide, config, feeds[:4], output_names,
                               reference, progress)
        for t, record in zip(targets, records, strict=True):
            if record.bits == 8:
                chosen[id(t.node)] = wide[id(t.node)]
        wide.clear()
    _rewrite_all(model, targets, chosen, config.fmt, config.accuracy_level)
    if config.embeddings:
        records += _quantize_embeddings(model, reader, config, patterns)
    ensure_opsets(model, config.fmt)
    cosine: dict[str, float] = {}

    def check(staged: Path) -> None:
        if feeds:
            cosine.update(_validate(staged, output_names, feeds[:4], reference))

    files = save_with_external_data(model, out, reader, check)
    result = WeightOnlyResult(out, files, records, skipped, cosine, source_bytes=_model_bytes(src),
                              output_bytes=sum(f.stat().st_size for f in files), mixed=search)
    result.seconds = time.perf_counter() - start
    return result


def _rewrite_all(model: onnx.ModelProto, targets: list[WeightMatMul], codes: dict[int, BlockQuantized],
                 fmt: WeightOnlyFormat, accuracy_level: int = 0) -> None:
    """Every target's node rewritten with its codes; float weights no other node reads are dropped."""
    consumers = _consumers(model)
    uses = {name: len(nodes) for name, nodes in consumers.items()}
    inits = {t.name: t for t in model.graph.initializer}
    outputs = {o.name for o in model.graph.output}
    for t in targets:
        model.graph.initializer.extend(rewrite_weight_matmul(model, t, codes[id(t.node)], fmt, accuracy_level))
        uses[t.weight] -= 1
        if uses[t.weight] == 0 and t.weight not in outputs:
            model.graph.initializer.remove(inits[t.weight])


def _quantize_embeddings(model: onnx.ModelProto, reader: ExternalDataReader, config: WeightOnlyConfig,
                         patterns: list[NamePattern]) -> list[LayerRecord]:
    """Each embedding Gather's table quantized per row in blocks along D (RTN, or HQQ with algorithm hqq)."""
    records = []
    for g in find_embedding_gathers(model):
        if any(p.matches(g.node.name) or p.matches(g.table) for p in patterns):
            continue
        inits = {t.name: t for t in model.graph.initializer}
        tensor = inits[g.table]
        table = torch.from_numpy(np.array(reader.array(tensor), dtype=np.float32))
        if not torch.isfinite(table).all():
            raise DataError(f"embedding table '{g.table}' holds NaN or Inf; fix the model or exclude it")
        quantize = quantize_hqq if config.algorithm is WeightAlgorithm.HQQ else quantize_rtn
        bq = quantize(table.t(), config.spec)
        mse = float(((bq.dequantize().t() - table) ** 2).mean())
        model.graph.initializer.extend(rewrite_embedding_gather(model, g, bq, config.fmt))
        if not _consumers(model).get(g.table) and g.table not in {o.name for o in model.graph.output}:
            model.graph.initializer.remove(tensor)
        records.append(LayerRecord(g.node.name, g.table, g.dim, g.vocab, mse, bits=config.bits))
    return records


@dataclass
class MixedSearch:
    """Mixed int4 / int8: layers ranked by sensitivity (relative output error of the layer at 4 bits on calibration
    rows), the smallest number k of most sensitive layers in int8 whose file keeps 1 - min output cosine vs FP32 within
    max_loss (bisection on k, each candidate run in onnxruntime); the losses measured per k tried."""

    max_loss: float
    int8_layers: int
    loss: float
    tried: dict[int, float]
    met: bool


def _mixed_search(model: onnx.ModelProto, base_dir: Path, targets: list[WeightMatMul], records: list[LayerRecord],
                  int4: dict[int, BlockQuantized], int8: dict[int, BlockQuantized], config: WeightOnlyConfig,
                  feeds: Sequence[Feeds], names: list[str], reference: list[list[np.ndarray]],
                  progress: Callable[[str], None] | None) -> MixedSearch:
    order = sorted(range(len(targets)), key=lambda i: (-(records[i].sensitivity or 0.0), i))
    tried: dict[int, float] = {}

    def loss(k: int) -> float:
        if k not in tried:
            wide = {id(targets[i].node) for i in order[:k]}
            candidate = onnx.ModelProto()
            candidate.CopyFrom(model)
            copies = [WeightMatMul(candidate.graph.node[list(model.graph.node).index(t.node)], t.activation, t.weight,
                                   t.k, t.n, t.transposed, t.bias) for t in targets]
            codes = {id(c.node): (int8 if id(t.node) in wide else int4)[id(t.node)]
                     for c, t in zip(copies, targets, strict=True)}
            _rewrite_all(candidate, copies, codes, config.fmt, config.accuracy_level)
            ensure_opsets(candidate, config.fmt)
            session = _Session(candidate, base_dir)
            try:
                worst = 1.0
                for feed, ref in zip(feeds, reference, strict=True):
                    for got, want in zip(session.run(names, feed), ref, strict=True):
                        worst = min(worst, _cosine(got, want))
            finally:
                session.close()
            tried[k] = 1.0 - worst
            if progress:
                progress(f"mixed int4/int8: {k} layers int8, loss {tried[k]:.5f}")
        return tried[k]

    budget = float(config.max_loss or 0.0)
    n = len(targets)
    if loss(0) <= budget:
        k, met = 0, True
    elif loss(n) > budget:
        k, met = n, False
    else:
        lo, hi = 0, n  # loss(lo) > budget >= loss(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if loss(mid) <= budget:
                hi = mid
            else:
                lo = mid
        k, met = hi, True
    for i in order[:k]:
        records[i].bits = 8
    return MixedSearch(budget, k, tried[k], dict(sorted(tried.items())), met)


def _model_bytes(path: Path) -> int:
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


def _validate(staged: Path, names: list[str], feeds: Sequence[Feeds], reference: list[list[np.ndarray]]
              ) -> dict[str, float]:
    """onnxruntime runs the staged file; per output the lowest cosine vs FP32 over the feeds. A file onnxruntime cannot
    run, or with non-finite outputs, is refused (ExportError; nothing is written)."""
    import onnxruntime as ort

    try:
        session = ort.InferenceSession(str(staged), providers=["CPUExecutionProvider"])
        outputs = [session.run(names, feed) for feed in feeds]
    except Exception as exc:
        raise ExportError(f"the weight-only file failed in onnxruntime, nothing written: {type(exc).__name__}: "
                          f"{exc}") from exc
    cos: dict[str, float] = {}
    for got_all, ref in zip(outputs, reference, strict=True):
        for name, got, want in zip(names, got_all, ref, strict=True):
            if not np.isfinite(got).all():
                raise ExportError(f"weight-only file: output '{name}' is not finite in onnxruntime; nothing written. "
                                  "Try 8 bits or exclude the layers that feed it")
            cos[name] = min(cos.get(name, 1.0), _cosine(got, want))
    return cos
