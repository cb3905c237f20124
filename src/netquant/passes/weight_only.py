"""Weight-only quantization of an ONNX model's MatMul / Gemm weights (int4 / int8, block-wise): choosing the codes.

    1. the weight MatMuls (`graph.weights.find_weight_matmuls`), minus `exclude` patterns (node or weight names,
       `core.selectors` language), and with `embeddings` the token-embedding Gathers;
    2. for data-aware algorithms (and the mixed int4 / int8 search), the FP32 model runs in onnxruntime with every
       weight MatMul's input exposed, accumulating `calib.input_stats.InputStatistics` per activation (Hessian for GPTQ,
       samples for AWQ and the layers' sensitivities);
    3. each weight's codes: RTN, HQQ, AWQ (per activation: the MatMuls reading it share one channel scale, folded into a
       norm-style producer's scale, the columns of an up_proj-style MatMul, or an explicit Mul) or GPTQ; with a loss
       budget also int8 RTN codes and each layer's 4-bit sensitivity (`analysis.weight_only_mixed` chooses).
The file is written by `export.weight_only`; `api.weight_only.quantize_weights_onnx` runs the whole flow. The source
model is never loaded whole: weights are read one at a time from their external data (memory-mapped).
"""

from __future__ import annotations

import enum
import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from netquant.calib.input_stats import InputStatistics
from netquant.core.awq import awq_search
from netquant.core.blockwise import BlockQuantized, BlockSpec, WeightOnlyFormat, quantize_hqq, quantize_rtn
from netquant.core.gptq import quantize_gptq
from netquant.core.selectors import NamePattern
from netquant.data.tokens import validation_feeds
from netquant.errors import ConfigError, DataError, ModelError
from netquant.graph.weights import (
    EmbeddingGather,
    ExternalDataReader,
    WeightMatMul,
    consumers_of,
    find_embedding_gathers,
    find_weight_matmuls,
)
from netquant.platforms.threads import apply_to_session_options, scoped_threads

Feeds = dict[str, np.ndarray]
_NORM_SCALE_INPUT = {("", "LayerNormalization"): (1, 2), ("", "SimplifiedLayerNormalization"): (1, None),
                     ("com.microsoft", "SimplifiedLayerNormalization"): (1, None),
                     ("com.microsoft", "SkipSimplifiedLayerNormalization"): (2, None),
                     ("com.microsoft", "SkipLayerNormalization"): (2, 3), ("", "RMSNormalization"): (1, None)}


class WeightAlgorithm(enum.Enum):
    """How block codes are chosen."""

    RTN = "rtn"    # round to nearest, block min / max
    HQQ = "hqq"    # half-quadratic l_p fit of block scales and zero points (always asymmetric; no data)
    AWQ = "awq"    # activation-aware channel scaling (alpha searched on the output error), then RTN
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
    embeddings: bool = True  # also the Gather tables (token embeddings): GatherBlockQuantized / blocked DQ + Gather
    head_bits: int | None = 8  # with bits=4: the output layer (lm_head) and embedding tables at this many bits
    #                            (8: NNCF's default backup precision; 4 or None: like every other layer)

    def __post_init__(self) -> None:
        if self.max_loss is not None and (not math.isfinite(self.max_loss) or not 0 <= self.max_loss < 1):
            raise ConfigError(f"weight-only max_loss={self.max_loss}: give a number in [0, 1), e.g. 0.01")
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ConfigError(f"weight-only accuracy_level={self.accuracy_level}: use 0 (float) .. 4 (int8 activations)")
        if self.max_loss is not None and self.bits != 4:
            raise ConfigError("weight-only max_loss mixes int4 and int8 layers: use it with bits=4")
        if self.head_bits not in (None, 4, 8):
            raise ConfigError(f"weight-only head_bits={self.head_bits}: use 8 (lm_head and embeddings in int8), 4 or "
                              "None (like the other layers)")

    @property
    def spec(self) -> BlockSpec:
        return BlockSpec(self.bits, self.block_size, self.symmetric)

    @property
    def wide_level(self) -> int | None:
        """MatMulNBits accuracy_level of the 8-bit layers of an int4 model: 4 (int8 activations; onnxruntime's 8-bit
        float kernel is ~40x slower than its 4-bit one), None for an all-int8 model (accuracy_level as given)."""
        return 4 if self.bits == 4 else None

    @property
    def head_spec(self) -> BlockSpec:
        """The format of the output layer and embedding tables (`head_bits`, or `bits` when None)."""
        return BlockSpec(self.head_bits or self.bits, self.block_size, self.symmetric)


def output_layers(model: onnx.ModelProto, targets: Sequence[WeightMatMul]) -> set[int]:
    """id(node) of the output layers (an LLM's lm_head): the targets whose output is a graph output, else the last
    target in graph order."""
    outputs = {o.name for o in model.graph.output}
    found = {id(t.node) for t in targets if t.node.output[0] in outputs}
    return found or ({id(targets[-1].node)} if targets else set())


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


def _excluded(target: WeightMatMul, patterns: list[NamePattern]) -> bool:
    return any(p.matches(target.node.name) or p.matches(target.weight) for p in patterns)


class OrtModelSession:
    """onnxruntime on a model proto (without its weights) whose external data lives in `base_dir`; `outputs` adds
    intermediate tensors as outputs. `prepack=False` skips onnxruntime's weight prepacking (a pass over every MatMul
    weight at session creation, 15x the rest of it on an LLM: worth it only for many runs; same outputs)."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path, outputs: Sequence[str] = (), prepack: bool = True,
                 threads: int | None = None) -> None:
        import onnxruntime as ort

        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        known = {o.name for o in probe.graph.output}
        for name in outputs:
            if name not in known:
                probe.graph.output.append(helper.make_empty_tensor_value_info(name))
        opts = ort.SessionOptions()
        opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        apply_to_session_options(opts)  # the thread_scope's threads, if any
        if threads is not None:
            opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(base_dir))
        if not prepack:
            opts.add_session_config_entry("session.disable_prepacking", "1")
        self.session = ort.InferenceSession(probe.SerializeToString(), opts, providers=["CPUExecutionProvider"])

    def run(self, names: Sequence[str], feeds: Feeds) -> list[np.ndarray]:
        return self.session.run(list(names), feeds)

    def close(self) -> None:
        del self.session


OVERLAP_BYTES = 512 << 20  # weights up to this size: the FP32 reference runs beside the quantization


def weight_bytes(model: onnx.ModelProto) -> int:
    """Bytes of the model's initializers (external ones by their recorded length), without reading them."""
    total = 0
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            total += int({e.key: e.value for e in t.external_data}.get("length", 0))
        else:
            total += t.ByteSize()
    return total


class ReferenceRuns:
    """The FP32 model's outputs on the validation feeds (onnxruntime). The session is made at once (from the model as
    it is now: AWQ edits the proto later); a model with weights up to OVERLAP_BYTES runs it on one background thread
    while the codes are chosen (onnxruntime releases the GIL: on a machine with a free core the validation costs no
    wall time), a larger one runs it at once and frees the session before quantizing (one copy of the weights in
    memory at a time). `result()` waits for the outputs."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path, names: Sequence[str], feeds: Sequence[Feeds],
                 prepack: bool) -> None:
        background = weight_bytes(model) <= OVERLAP_BYTES
        session = OrtModelSession(model, base_dir, prepack=prepack, threads=1 if background else None)
        names, feeds = list(names), list(feeds)

        def run() -> list[list[np.ndarray]]:
            try:
                return [session.run(names, f) for f in feeds]
            finally:
                session.close()

        if background:
            pool = ThreadPoolExecutor(1, thread_name_prefix="netquant-reference")
            self._future: Future[list[list[np.ndarray]]] | None = pool.submit(run)
            pool.shutdown(wait=False)
            self._outputs: list[list[np.ndarray]] = []
        else:
            self._future, self._outputs = None, run()

    def result(self) -> list[list[np.ndarray]]:
        return self._future.result() if self._future is not None else self._outputs


def collect_input_statistics(model: onnx.ModelProto, base_dir: Path, targets: list[WeightMatMul],
                             feeds: Sequence[Feeds], with_hessian: bool,
                             progress: Callable[[str], None] | None = None) -> dict[str, InputStatistics]:
    """Per activation read by a target, its InputStatistics over the calibration feeds (FP32, onnxruntime)."""
    acts = list(dict.fromkeys(t.activation for t in targets))
    k_of = {t.activation: t.k for t in targets}
    stats = {a: InputStatistics(k_of[a], with_hessian=with_hessian) for a in acts}
    session = OrtModelSession(model, base_dir, acts)
    try:
        for i, feed in enumerate(feeds):
            for name, value in zip(acts, session.run(acts, feed), strict=True):
                stats[name].observe(torch.from_numpy(np.asarray(value, dtype=np.float32)), name)
            if progress:
                progress(f"calibration batch {i + 1}/{len(feeds)}")
    finally:
        session.close()
    return stats


def _non_finite(target: WeightMatMul) -> DataError:
    return DataError(f"weight '{target.weight}' of node '{target.node.name}' holds NaN or Inf; fix the model "
                     "or exclude the node (exclude=['name:...'])")


def _weight_kn(reader: ExternalDataReader, tensor: onnx.TensorProto, target: WeightMatMul) -> torch.Tensor:
    w = torch.from_numpy(np.array(reader.array(tensor), dtype=np.float32))
    if not math.isfinite(float(w.sum())) and not bool(torch.isfinite(w).all()):  # a finite sum: all finite
        raise _non_finite(target)
    return w.t() if target.transposed else w


def _codes_from_file(reader: ExternalDataReader, tensor: onnx.TensorProto, target: WeightMatMul, spec: BlockSpec,
                     hqq: bool = False) -> BlockQuantized:
    """RTN (or HQQ) codes of a weight read in place from its (memory-mapped) data: no copy, no separate finiteness
    pass (a NaN or Inf weight makes its block's scale non-finite)."""
    w = reader.array(tensor)
    quantize = quantize_hqq if hqq else quantize_rtn
    bq = quantize(w.T if target.transposed else w, spec, threads=scoped_threads() or 1)
    if not bool(np.isfinite(bq.scales.numpy()).all()):
        raise _non_finite(target)
    return bq


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


@dataclass
class WeightOnlyPlan:
    """A model ready to be written: the (AWQ-edited) weightless model proto, where its data lives, the targets with
    their codes (by id(node)), int8 alternatives when a loss budget is set, embeddings, records, and the FP32 outputs
    on the validation feeds."""

    model: onnx.ModelProto
    source: Path
    reader: ExternalDataReader
    targets: list[WeightMatMul]
    codes: dict[int, BlockQuantized]
    wide: dict[int, BlockQuantized]
    embeddings: list[tuple[EmbeddingGather, BlockQuantized]]
    records: list[LayerRecord]
    skipped: list[str]
    feeds: list[Feeds]
    reference: list[list[np.ndarray]]

    @property
    def output_names(self) -> list[str]:
        return [o.name for o in self.model.graph.output]


def load_weightless(model_path: str | os.PathLike[str], outputs: Sequence[Path]) -> tuple[onnx.ModelProto, Path]:
    """The model proto without its external data, and its resolved path; refuses outputs that are the model or one of
    its data files (inputs are never overwritten)."""
    src = Path(model_path).resolve()
    if not src.is_file():
        raise ModelError(f"model '{model_path}' does not exist")
    try:
        model = onnx.load_model(str(src), load_external_data=False)
    except Exception as exc:
        raise ModelError(f"model '{src}' cannot be read as ONNX ({type(exc).__name__}: {exc})") from exc
    locations = {{e.key: e.value for e in t.external_data}.get("location", "")
                 for t in model.graph.initializer if t.data_location == TensorProto.EXTERNAL}
    inputs = {src} | {(src.parent / loc).resolve() for loc in locations}
    for out in outputs:
        if out.resolve() in inputs:
            raise ConfigError(f"output '{out}' is the input model or its external data; choose another path "
                              "(inputs are never overwritten)")
    return model, src


def plan_weight_only(model: onnx.ModelProto, source: Path, config: WeightOnlyConfig, feeds: Sequence[Feeds] = (),
                     progress: Callable[[str], None] | None = None) -> WeightOnlyPlan:
    """Codes for every target of `model` (read from beside `source`) under `config` (module docstring)."""
    if (config.algorithm.needs_data or config.max_loss is not None) and not feeds:
        what = "mixed int4 / int8 (max_loss)" if config.max_loss is not None else config.algorithm.value
        raise DataError(f"weight-only {what} needs calibration data; give feeds / --calib, or use algorithm rtn or "
                        "hqq without max_loss")
    reader = ExternalDataReader(source.parent)
    patterns = [NamePattern.parse(p) for p in config.exclude]
    all_targets = find_weight_matmuls(model)
    targets = [t for t in all_targets if not _excluded(t, patterns)]
    skipped = [t.node.name for t in all_targets if _excluded(t, patterns)]
    if not targets:
        raise ModelError(f"model '{source}' has no MatMul / Gemm with a constant 2-D float weight (K >= 16) to "
                         "quantize" + (f" outside the excluded {list(config.exclude)}" if skipped else ""))
    spec = config.spec
    output_names = [o.name for o in model.graph.output]
    feeds = list(feeds) or validation_feeds(model)  # without data the file is still checked on random inputs
    stats: dict[str, InputStatistics] = {}
    if config.algorithm.needs_data or config.max_loss is not None:
        stats = collect_input_statistics(model, source.parent, targets, feeds,
                                         config.algorithm is WeightAlgorithm.GPTQ, progress)
    # a few runs: prepacking costs more than it saves (outputs equal to ~1e-7 relative; the mixed int4 / int8 search
    # compares candidates against this reference, so it keeps onnxruntime's default)
    reference_runs = ReferenceRuns(model, source.parent, output_names, feeds[:4], prepack=config.max_loss is not None)
    inits = {t.name: t for t in model.graph.initializer}
    consumers = consumers_of(model)
    quantized: dict[int, tuple[BlockQuantized, float, torch.Tensor]] = {}
    overrides: dict[str, torch.Tensor] = {}  # weights [K, N] changed before quantization (AWQ folds)
    head_spec = config.head_spec
    heads = output_layers(model, targets) if head_spec != spec else set()
    if config.algorithm is WeightAlgorithm.AWQ:
        groups: dict[str, list[WeightMatMul]] = {}
        for t in targets:
            if id(t.node) not in heads:  # the output layer at head_bits is plain RTN
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
    codes: dict[int, BlockQuantized] = {}
    wide: dict[int, BlockQuantized] = {}
    records: list[LayerRecord] = []
    spec8 = BlockSpec(8, spec.block_size, spec.symmetric)
    for i, t in enumerate(targets):
        data_free = id(t.node) in heads or config.algorithm in (WeightAlgorithm.RTN, WeightAlgorithm.HQQ)
        if data_free and config.max_loss is None and t.weight not in overrides and id(t.node) not in quantized:
            hqq = config.algorithm is WeightAlgorithm.HQQ and id(t.node) not in heads
            bq = _codes_from_file(reader, inits[t.weight], t, head_spec if id(t.node) in heads else spec, hqq)
            codes[id(t.node)] = bq
            records.append(LayerRecord(t.node.name, t.weight, t.k, t.n, float(bq.known_mse or 0.0), None,
                                       bits=bq.spec.bits))
            if progress:
                progress(f"quantized {i + 1}/{len(targets)}: {t.node.name or t.weight}")
            continue
        w = overrides.pop(t.weight) if t.weight in overrides else _weight_kn(reader, inits[t.weight], t)
        if id(t.node) in quantized:
            bq, awq_alpha, awq_scale = quantized.pop(id(t.node))
            alpha: float | None = awq_alpha
            w_eff = w * awq_scale.unsqueeze(1)
            mse = float(((bq.dequantize() / awq_scale.unsqueeze(1) - w) ** 2).mean())
        else:
            alpha, w_eff = None, w
            if id(t.node) in heads:
                bq = quantize_rtn(w, head_spec)
            elif config.algorithm is WeightAlgorithm.GPTQ:
                bq = quantize_gptq(w, stats[t.activation].hessian(t.activation), spec, act_order=config.act_order,
                                   name=t.weight)
            elif config.algorithm is WeightAlgorithm.HQQ:
                bq = quantize_hqq(w, spec, threads=scoped_threads() or 1)
            else:
                bq = quantize_rtn(w, spec)
            mse = bq.known_mse if bq.known_mse is not None else bq.mse(w)
        codes[id(t.node)] = bq
        record = LayerRecord(t.node.name, t.weight, t.k, t.n, mse, alpha, bits=bq.spec.bits)
        if config.max_loss is not None:
            wide[id(t.node)] = quantize_rtn(w_eff, spec8)
            rows = stats[t.activation].sample_rows()
            ref = rows @ w_eff
            record.sensitivity = float(((rows @ bq.dequantize() - ref) ** 2).sum() / (ref * ref).sum().clamp_min(1e-30))
        records.append(record)
        if progress:
            progress(f"quantized {i + 1}/{len(targets)}: {t.node.name or t.weight}")
    embeddings = _embedding_codes(model, reader, config, patterns, records) if config.embeddings else []
    reference = reference_runs.result()
    return WeightOnlyPlan(model, source, reader, targets, codes, wide, embeddings, records, skipped, feeds, reference)


def _embedding_codes(model: onnx.ModelProto, reader: ExternalDataReader, config: WeightOnlyConfig,
                     patterns: list[NamePattern], records: list[LayerRecord]
                     ) -> list[tuple[EmbeddingGather, BlockQuantized]]:
    """Each embedding Gather's table quantized per row in blocks along D (RTN, or HQQ with algorithm hqq)."""
    inits = {t.name: t for t in model.graph.initializer}
    found = []
    for g in find_embedding_gathers(model):
        if any(p.matches(g.node.name) or p.matches(g.table) for p in patterns):
            continue
        # straight from the mapped data (a NaN or Inf row makes its scale non-finite)
        quantize = quantize_hqq if config.algorithm is WeightAlgorithm.HQQ else quantize_rtn
        bq = quantize(reader.array(inits[g.table]).T, config.head_spec, threads=scoped_threads() or 1)
        if not bool(np.isfinite(bq.scales.numpy()).all()):
            raise DataError(f"embedding table '{g.table}' holds NaN or Inf; fix the model or exclude it")
        records.append(LayerRecord(g.node.name, g.table, g.dim, g.vocab, float(bq.known_mse or 0.0),
                                   bits=bq.spec.bits))
        found.append((g, bq))
    return found
