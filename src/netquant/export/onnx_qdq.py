"""export_qdq: a QuantizedGraph -> a validated ONNX QDQ file (opset >= 13), written atomically."""

from __future__ import annotations

import os
import tempfile
import time
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import onnx
import torch

from netquant.atomic import atomic_path
from netquant.core.int_kernels import Accumulation
from netquant.errors import ExportError
from netquant.export.dynamic import make_dynamic
from netquant.export.fidelity import (
    DEFAULT_MIN_COSINE,
    EngineComparison,
    check_vs_fp32,
    compare_with_fp32,
    confirmed_vs_fp32,
)
from netquant.export.layer_norm_apart import keep_layer_norms_apart
from netquant.export.opset import (
    BIG_INITIALIZER_BYTES,
    ai_onnx_opset,
    check_opset_request,
    check_same_outputs,
    lower_ir_version,
    model_bytes,
    split_big_initializers,
    upgrade_light,
)
from netquant.export.ort_kernels import (
    int8_kernels_of,
    ort_optimized_op_types,
    ort_runtime_qdq,
    saved_op_types,
)
from netquant.export.ort_patterns import (
    drop_zero_weight_zero_points,
    embed_layer_norm_rows,
    gather_int8_rows,
    keep_qdq_matmul_bias_apart,
    q_attention,
)
from netquant.export.qdq import QdqBuilder, required_opset
from netquant.export.ranks import RankOf
from netquant.export.slim import share_equal_initializers, strip_node_metadata
from netquant.export.slots import Exportable, check_deployable, unwrap
from netquant.export.validate import (
    DEFAULT_MAX_ERROR_RATIO,
    check_model,
    check_target_arithmetic,
    compare_with_executor,
    ort_session,
    validation_feeds,
)
from netquant.passes.quant_graph import QuantizedGraph
from netquant.platforms.heap import long_lived_frozen
from netquant.platforms.ort_probes import skip_layer_norm_probe
from netquant.platforms.platform import Validation
from netquant.platforms.targets import host_accumulation
from netquant.platforms.threads import scoped_threads, thread_scope


@dataclass
class ExportReport:
    """What export_qdq wrote and how it was checked."""

    path: Path
    opset: int
    source_opset: int
    fp32_bytes: int
    size_bytes: int
    quantize_nodes: int
    dequantize_nodes: int
    integer_initializers: int
    quantized_ops: list[str]
    validated: bool
    output_cosine: dict[str, float] = field(default_factory=dict)  # onnxruntime vs fake-quant, per output
    output_max_abs_diff: dict[str, float] = field(default_factory=dict)
    validation_batches: int = 0
    accumulation: Accumulation | None = None  # this machine's int8 arithmetic, which validation emulated
    validated_with: str = ""  # which engine ran the file: validation_label(platform.validation), "" if not validated
    reference_only: bool = False  # the target engine does not run here: checked in the Q/DQ reference semantics only
    cpu_target: str | None = None
    int8_kernels: dict[str, int] | None = None
    runtime_qdq: int | None = None  # Q + DQ nodes onnxruntime still runs after fusing (None: not checked)
    engine: str = ""  # the engine that ran the file when it is not onnxruntime (e.g. "OpenVINO 2026.4.1 (CPU plugin ...)")
    int8_layers: dict[str, int] | None = None  # that engine's heavy runtime layers running in int8, per layer type
    heavy_layers: int | None = None  # all its heavy (Convolution / MatMul / FullyConnected) runtime layers
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    vs_fp32: EngineComparison | None = None  # the file in its engine vs the FP32 model in onnxruntime (validated)

    @property
    def opset_upgraded(self) -> bool:
        return self.opset > self.source_opset

    @property
    def compression(self) -> float:
        """FP32 size / exported size."""
        return self.fp32_bytes / max(1, self.size_bytes)

    def summary(self) -> str:
        cos = ", ".join(f"{k}: {v:.5f}" for k, v in self.output_cosine.items()) or "not validated"
        kernels = ", ".join(f"{k} x{v}" for k, v in (self.int8_kernels or {}).items()) or "none"
        target = f"; CPU target {self.cpu_target}" if self.cpu_target else ""
        checked = (f" over {self.validation_batches} batch(es) in {self.validated_with}, "
                   f"{self.accumulation.value} int8 arithmetic" if self.accumulation is not None else "")
        if self.int8_layers is not None:
            kernels = (", ".join(f"{k} x{v}" for k, v in self.int8_layers.items()) or "none") + \
                f" ({sum(self.int8_layers.values())} / {self.heavy_layers} heavy layers)"
        if self.reference_only:
            checked += f" ({REFERENCE_ONLY_NOTE})"
        return (f"{self.path}: opset {self.source_opset}->{self.opset}, {len(self.quantized_ops)} ops quantized, "
                f"{self.quantize_nodes} Q / {self.dequantize_nodes} DQ, {self.fp32_bytes / 1e6:.2f} MB -> "
                f"{self.size_bytes / 1e6:.2f} MB ({self.compression:.1f}x){target}; cosine vs executor {cos}{checked}; "
                f"{'int8 layers in ' + self.engine.split(' (')[0] if self.engine else 'onnxruntime int8 kernels'}: {kernels}"
                + (f" ({self.runtime_qdq} Q/DQ left at runtime)" if self.runtime_qdq is not None else "")
                + (f"; {self.vs_fp32.line()}" if self.vs_fp32 is not None else ""))


VALIDATION_LABELS = {
    Validation.ONNXRUNTIME: "onnxruntime (optimized, this CPU)",
    Validation.QDQ_REFERENCE: "Q/DQ reference (onnxruntime, graph optimizations off)",
}
REFERENCE_ONLY_NOTE = ("the target engine does not run here: the file was checked in the Q/DQ reference semantics "
                       "only (Q/DQ as defined by ONNX), not in that engine")


def validation_label(validation: Validation) -> str:
    """The engine that validates a platform's file, in words (ExportReport.validated_with)."""
    return VALIDATION_LABELS.get(validation, validation.value)


@dataclass
class _Fp32Base:
    """The FP32 model a QDQ export starts from: the cleaned graph as ONNX, upgraded to the export's opset, kept as a
    skeleton (everything but the large initializers) plus those initializers, which live once, in `fp32`: a build
    copies the skeleton and only the large initializers its model still reads (not the weights it quantizes)."""

    key: tuple[Any, ...]  # passes.calibration.graph_state of the graph it was made from
    fp32: onnx.ModelProto  # the cleaned graph as ONNX, at its own opset (float32 weights: see `pending`)
    skeleton: onnx.ModelProto  # fp32 upgraded to the target opset, without the `big` initializers
    big: list[onnx.TensorProto]  # fp32's large initializers (its own messages), after the skeleton's in order
    source_opset: int
    fp32_bytes: int
    checked: bool  # the upgrade was run against the original on real feeds (or there was none)
    # the large float32 initializers written as headers only (graph.save.to_onnx's headers_above) and the graph's
    # tensors to fill them from: a build reads only their headers (it quantizes from the graph's tensors), so their
    # data is written where a model still holds them (fill): BERT-base's 440 MB are not converted for its builds
    pending: dict[str, Any] = field(default_factory=dict)

    @property
    def upgraded(self) -> bool:
        return ai_onnx_opset(self.skeleton) != self.source_opset

    def fill(self, tensors: Iterable[onnx.TensorProto] | None = None) -> None:
        """Write the data of the header-only initializers among `tensors` (default: all of `big`), in place."""
        from netquant.graph.save import fill_initializer

        for t in self.big if tensors is None else tensors:
            value = self.pending.pop(t.name, None)
            if value is not None:
                fill_initializer(t, value)

    def whole(self) -> onnx.ModelProto:
        """The upgraded model with every initializer (a copy: for the rare checks that run it)."""
        self.fill()
        if not self.upgraded:
            return self.fp32
        model = onnx.ModelProto()
        model.CopyFrom(self.skeleton)
        model.graph.initializer.extend(self.big)
        return model


_FP32_BASES: weakref.WeakKeyDictionary[Any, _Fp32Base] = weakref.WeakKeyDictionary()


def _fp32_base(qgraph: QuantizedGraph, need: int, feeds: dict[str, Any] | None) -> _Fp32Base:
    """The upgraded FP32 model of qgraph's graph as it is now (memoised per quantized graph and graph state: the
    placement's candidate builds and the export share one conversion and one upgrade check)."""
    from netquant.graph import to_onnx
    from netquant.graph.save import fill_output_shapes
    from netquant.passes.calibration import graph_state

    key = graph_state(qgraph.graph)
    base = _FP32_BASES.get(qgraph)
    if base is not None and base.key == key and ai_onnx_opset(base.skeleton) >= need and \
            (base.checked or feeds is None):
        return base
    # the exported model is checked (validate=True), not the source; large float32 weights as headers (pending)
    fp32 = to_onnx(qgraph.graph, check=False, headers_above=BIG_INITIALIZER_BYTES)
    fill_output_shapes(fp32, qgraph.graph)
    if fp32.ir_version < 4:  # IR 3 lists every initializer among the inputs; IR 4 on needs no such copies
        inits = {t.name for t in fp32.graph.initializer}
        inputs = [v for v in fp32.graph.input if v.name not in inits]
        del fp32.graph.input[:]
        fp32.graph.input.extend(inputs)
        fp32.ir_version = 4
    source = ai_onnx_opset(fp32)
    light, big = split_big_initializers(fp32)
    skeleton = upgrade_light(light, big, max(need, source))
    inits = qgraph.graph.initializers
    pending = {t.name: inits[t.name] for t in big if not t.raw_data and t.data_location != onnx.TensorProto.EXTERNAL
               and t.data_type == onnx.TensorProto.FLOAT and isinstance(inits.get(t.name), torch.Tensor)}
    base = _Fp32Base(key, fp32, skeleton, big, source, model_bytes(fp32), checked=True, pending=pending)
    if base.upgraded:
        base.checked = feeds is not None
        if feeds is not None:
            check_same_outputs(fp32, base.whole(), feeds,
                               f"upgrading '{qgraph.graph.name}' from opset {source} to {ai_onnx_opset(skeleton)}")
    _FP32_BASES[qgraph] = base
    return base


def check_upgrade(qgraph: QuantizedGraph, feeds: dict[str, Any]) -> None:
    """ExportError when the opset upgrade of qgraph's FP32 model (if one was made) changes an output on `feeds`."""
    base = _FP32_BASES.get(qgraph)
    if base is not None and base.upgraded and not base.checked:
        base.fill()
        check_same_outputs(base.fp32, base.whole(), feeds, f"upgrading '{qgraph.graph.name}' from opset "
                           f"{base.source_opset} to {ai_onnx_opset(base.skeleton)}")
        base.checked = True


def fp32_onnx(qgraph: QuantizedGraph) -> onnx.ModelProto:
    """The quantized graph's cleaned FP32 graph as ONNX (shared with the QDQ builds; do not modify it)."""
    base = _fp32_base(qgraph, required_opset(qgraph), None)
    base.fill()
    return base.fp32


def fp32_onnx_headers(qgraph: QuantizedGraph) -> onnx.ModelProto:
    """fp32_onnx without writing the large float32 weights' data where no build has needed it yet: those initializers
    may be headers only (name, type, dims), their values in qgraph.graph.initializers (model_hash reads them there).
    Do not modify it or hand it to an engine."""
    return _fp32_base(qgraph, required_opset(qgraph), None).fp32


def quant_state(qgraph: QuantizedGraph) -> tuple[Any, ...]:
    """What a QDQ build depends on: graph_state (nodes, initializers) and every op config (identity, state, spec,
    pair limit, root and its params' tensors with torch's in-place version counters)."""
    from netquant.passes.calibration import graph_state

    def tensor(t: Any) -> tuple[int, int]:
        return id(t), getattr(t, "_version", 0)

    configs = []
    for name, oc in qgraph.op_configs.items():
        for c in (*oc.inputs, *oc.outputs):
            if c is None:
                configs.append(None)
                continue
            r, p = c.root, c.root.params
            configs.append((id(c), c.state, c.spec, c.effective_pair_limit, id(r), r.state,
                            None if p is None else (id(p), tensor(p.scale), tensor(p.zero_point))))
        configs.append(name)
    return (graph_state(qgraph.graph), tuple(configs), id(qgraph.platform), tuple(sorted(qgraph.dynamic_ops)),
            qgraph.attention_rewrite)


_Built = tuple[onnx.ModelProto, QdqBuilder, int]
SHARED_BUILDS = 3  # shared builds kept per quantized graph (the latest ones)
_SHARED: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], _Built]] = weakref.WeakKeyDictionary()


def build_qdq_model(qmodel: Exportable, *, opset: int | None = None, feeds: dict[str, Any] | None = None,
                    share: bool = False) -> tuple[onnx.ModelProto, QdqBuilder, int]:
    """The QDQ ModelProto (not validated, not written), the builder (stats) and the source opset.

    When the opset must be raised and `feeds` is given, the upgrade is checked to change no output.
    share: the caller will not modify the model; it is kept (with the SHARED_BUILDS latest shared builds of the
    graph), and a later call in the same state (quant_state) and opset takes it instead of building it again
    (placement's candidates, its DYNAMIC and attention steps, then the export of the decision). A call without
    share takes a kept build of its state and empties the graph's kept builds (it may modify what it gets).
    """

    qgraph = unwrap(qmodel)
    key = (quant_state(qgraph), opset)
    kept = _SHARED.get(qgraph)
    result = kept.pop(key, None) if kept is not None and feeds is None else None
    if result is None:
        result = _build(qgraph, opset, feeds)
    if share:
        kept = _SHARED.setdefault(qgraph, {})
        kept[key] = result  # the latest last
        while len(kept) > SHARED_BUILDS:
            del kept[next(iter(kept))]
    else:
        _SHARED.pop(qgraph, None)
    return result


def _build(qgraph: QuantizedGraph, opset: int | None,
           feeds: dict[str, Any] | None) -> tuple[onnx.ModelProto, QdqBuilder, int]:
    check_opset_request(opset)
    check_deployable(qgraph)
    need = required_opset(qgraph)
    if opset is not None and opset < need:
        raise ExportError(f"opset {opset} cannot express this model's quantizers (needs >= {need}: per-axis "
                          "QDQ 13, FP8 19, int16 / per-group 21)")
    base = _fp32_base(qgraph, max(need, opset or 0), feeds)
    model = onnx.ModelProto()
    model.CopyFrom(base.skeleton)
    source = base.source_opset
    builder = QdqBuilder(qgraph, model, external=base.big, complete=base.fill)
    builder.stats.fp32_bytes = base.fp32_bytes
    model = builder.build()
    rewritten = bool(qgraph.dynamic_ops and make_dynamic(model, qgraph.dynamic_ops))
    if qgraph.attention_rewrite is not None:  # transformer ops int8 by measurement (analysis.attention)
        rewritten = qgraph.attention_rewrite.apply(model) or rewritten
    if qgraph.platform.validation is Validation.ONNXRUNTIME:  # exact rewrites for onnxruntime's fusions
        rank_of = RankOf(qgraph.graph)  # through com.microsoft ops too, where onnx shape inference stops
        keep_qdq_matmul_bias_apart(model, rank_of)
        rewritten = embed_layer_norm_rows(model) > 0 or rewritten  # before gather_int8_rows: it makes Gathers
        rewritten = gather_int8_rows(model) > 0 or rewritten
        rewritten = q_attention(model) > 0 or rewritten
        rewritten = keep_layer_norms_apart(model, _fused_skip_layer_norm_slower) > 0 or rewritten
        drop_zero_weight_zero_points(model, rank_of)
    strip_node_metadata(model)  # exporters' per-node annotations: no engine reads them (export.slim)
    share_equal_initializers(model)  # e.g. the zero biases of fresh layers, once each
    if rewritten:  # the stats count what the file holds
        ops = Counter(n.op_type for n in model.graph.node)
        builder.stats.quantize_nodes, builder.stats.dequantize_nodes = ops["QuantizeLinear"], ops["DequantizeLinear"]
    # an old IR (3: initializers listed as inputs) cannot hold the upgraded opset's Q/DQ initializers
    model.ir_version = max(model.ir_version, onnx.helper.find_min_ir_version_for(list(model.opset_import),
                                                                                 ignore_unknown=True))
    lower_ir_version(model)
    model.producer_name, model.producer_version = "netquant", _version()
    platform = qgraph.platform.name
    if platform:
        onnx.helper.set_model_props(model, {**{p.key: p.value for p in model.metadata_props},
                                            "netquant.platform": platform})
    return model, builder, source


def _version() -> str:
    from netquant import __version__

    return __version__


def export_qdq(qmodel: Exportable, path: str | os.PathLike[str], *, opset: int | None = None, validate: bool = True,
               sample: Any = None, min_cosine: float = 0.98, max_error_ratio: float | None = DEFAULT_MAX_ERROR_RATIO,
               check_kernels: bool = True, min_fp32_cosine: float | None = DEFAULT_MIN_COSINE) -> ExportReport:
    """Write `qmodel` as an ONNX QDQ model at `path`, whole or not at all.

    validate: onnx.checker, onnxruntime load, the platform's CPU target (no int8 weight pair that its int16
        pair sums can overflow), and batches (`sample`, else the calibration batches the quantizer kept, else
        random) run in onnxruntime and in the executor's fake-quant run with this machine's int8 arithmetic
        emulated: every output of onnxruntime must be as close to FP32 as the fake-quant run's (1 - cosine within
        max_error_ratio times the fake-quant's, plus 0.002); max_error_ratio None: cosine(onnxruntime, fake-quant)
        >= min_cosine instead (validate.Agreement). The same outputs are compared with the FP32 model in onnxruntime
        (export.fidelity; ExportReport.vs_fp32), and both files timed where onnxruntime is the engine; an output whose
        cosine vs FP32 is below min_fp32_cosine (None: no check) is refused.
    check_kernels: record which int8 kernels onnxruntime runs after its optimizations.
    Raises ExportError (and leaves no file) on any failure.
    Runs under platforms.threads.thread_scope: the threads quantization used (QuantizedModel.threads), else the
    policy's.
    """
    with thread_scope(getattr(qmodel, "threads", None)), long_lived_frozen():
        return _export_qdq(qmodel, path, opset, validate, sample, min_cosine, max_error_ratio, check_kernels,
                           min_fp32_cosine)


def _export_qdq(qmodel: Exportable, path: str | os.PathLike[str], opset: int | None, validate: bool, sample: Any,
                min_cosine: float, max_error_ratio: float | None, check_kernels: bool,
                min_fp32_cosine: float | None) -> ExportReport:
    start = time.perf_counter()
    qgraph = unwrap(qmodel)
    where = str(path)
    batches = validation_feeds(qgraph, sample) if validate else []
    if validate:
        check_target_arithmetic(qgraph, where)
    # the opset upgrade is not run against the original here: validation compares the exported model with the
    # executor anyway, and only when that fails does check_upgrade say whether the converter was the cause
    model, builder, source = build_qdq_model(qgraph, opset=opset)
    agreement = {}
    vs_fp32: EngineComparison | None = None
    record: dict[str, list[Any]] = {}
    counts: Counter[str] | None = None
    in_engine = qgraph.platform.validation is Validation.ONNXRUNTIME
    ov_check, ov_note = None, ""
    if qgraph.platform.validation is Validation.OPENVINO:
        from netquant.export.openvino import openvino_available, openvino_form, validate_in_openvino

        openvino_form(model)
        in_engine, check_kernels = openvino_available(), False
        ov_note = "" if in_engine else " (openvino not installed: OpenVINO could not be checked)"
    # fused int8 kernels run this machine's arithmetic; the Q/DQ reference computes exactly
    accumulation = (host_accumulation() if in_engine else Accumulation.EXACT) if validate else None
    with atomic_path(path, "ONNX model") as tmp:
        if validate:
            check_model(model, where)
        onnx.save(model, str(tmp))
        if validate:
            if qgraph.platform.validation is Validation.OPENVINO and in_engine:
                ov_check = validate_in_openvino(qgraph, tmp, batches, where, min_cosine, max_error_ratio)
                agreement = ov_check.agreement
                vs_fp32 = compare_with_fp32(qgraph, ov_check.outputs, batches, ov_check.engine.split(" (")[0],
                                            sample_given=sample is not None)
                check_vs_fp32(vs_fp32, min_fp32_cosine, where)
            else:  # the optimized graph onnxruntime saves while loading gives the kernel counts (one session)
                with tempfile.TemporaryDirectory(prefix="netquant_ort_") as work:
                    saved = str(Path(work) / "optimized.onnx") if check_kernels and in_engine else None
                    sess = _ort_session(model, tmp, where, optimized=in_engine, save_optimized=saved)
                    try:
                        agreement = compare_with_executor(qgraph, sess, batches, where, min_cosine, accumulation,
                                                          max_error_ratio, record=record,
                                                          engine_runs=_placement_runs(qgraph, model, batches,
                                                                                      in_engine),
                                                          confirm=sample is None)
                    except ExportError:
                        check_upgrade(qgraph, batches[0])
                        raise
                    vs_fp32 = compare_with_fp32(qgraph, record, batches, "onnxruntime" if in_engine else
                                                "the Q/DQ reference (onnxruntime, graph optimizations off)",
                                                sample_given=sample is not None,
                                                int8_session=sess if in_engine else None)
                    if sample is None:
                        vs_fp32 = confirmed_vs_fp32(qgraph, vs_fp32, record, batches, sess, min_fp32_cosine, where)
                    check_vs_fp32(vs_fp32, min_fp32_cosine, where)
                    counts = saved_op_types(saved) if saved is not None else None
    target = Path(path)
    if counts is None and check_kernels:
        counts = ort_optimized_op_types(target)
    kernels = int8_kernels_of(counts) if counts is not None else None
    return ExportReport(
        path=target, opset=ai_onnx_opset(model), source_opset=source,
        fp32_bytes=builder.stats.fp32_bytes, size_bytes=target.stat().st_size,
        quantize_nodes=builder.stats.quantize_nodes, dequantize_nodes=builder.stats.dequantize_nodes,
        integer_initializers=builder.stats.integer_initializers, quantized_ops=builder.stats.quantized_ops,
        validated=validate, validated_with=("" if not validate else ov_check.engine if ov_check is not None
                                            else validation_label(Validation.ONNXRUNTIME if in_engine
                                                                  else Validation.QDQ_REFERENCE) + ov_note),
        reference_only=validate and ov_check is None and not in_engine,
        output_cosine={k: a.ort_vs_fake_quant for k, a in agreement.items()},
        output_max_abs_diff={k: a.max_abs_diff for k, a in agreement.items()},
        validation_batches=max((a.batches for a in agreement.values()), default=len(batches)),
        accumulation=accumulation, cpu_target=qgraph.platform.cpu_target.value if qgraph.platform.cpu_target is not None else None,
        int8_kernels=kernels,
        runtime_qdq=ort_runtime_qdq(counts) if counts is not None else None,
        engine=ov_check.engine if ov_check is not None else "",
        int8_layers=ov_check.int8_layers if ov_check is not None else None,
        heavy_layers=ov_check.heavy if ov_check is not None else None,
        warnings=list(builder.stats.warnings), seconds=time.perf_counter() - start, vs_fp32=vs_fp32)


def _fused_skip_layer_norm_slower(hidden: int) -> bool:
    """onnxruntime's SkipLayerNormalization measured slower here than Add + LayerNormalization (platforms.ort_probes)."""
    return skip_layer_norm_probe(hidden).fused_slower


def _placement_runs(qgraph: QuantizedGraph, model: onnx.ModelProto, batches: Sequence[dict[str, Any]],
                    in_engine: bool) -> dict[int, list[Any]]:
    """Batch index -> placement's onnxruntime outputs of this very model object on that batch, in a session of the
    threads the validation session gets (QuantizedGraph.engine_outputs; optimized sessions only)."""
    if not in_engine or not batches:
        return {}
    got = qgraph.engine_outputs(model, batches[0], scoped_threads())
    return {0: got} if got is not None else {}


ORT_DOMAINS = ("", "ai.onnx", "ai.onnx.ml", "com.microsoft", "com.microsoft.nchwc", "com.ms.internal.nhwc",
               "ai.onnx.preview.training", "ai.onnx.training")


def _ort_session(model: onnx.ModelProto, tmp: Path, where: str, optimized: bool = True,
                 save_optimized: str | None = None) -> Any:
    """ort_session on the temp file, its errors naming the user's path and the ops onnxruntime cannot load."""
    local = {(f.domain, f.name) for f in model.functions}
    custom = [n for g in _graphs(model.graph) for n in g.node
              if n.domain not in ORT_DOMAINS and (n.domain, n.op_type) not in local]
    if custom:
        names = ", ".join(f"'{n.name}' ({n.domain}::{n.op_type})" for n in custom[:5])
        raise ExportError(f"exported model for '{where}' cannot be validated: onnxruntime has no kernel for "
                          f"custom-domain node(s) {names}. Keep them out of the model, or export without "
                          "validation (Python: export(..., validate=False)) for an engine that implements them")
    try:
        return ort_session(str(tmp), where, optimized, save_optimized)
    except ExportError as exc:
        message = str(exc).replace(str(tmp.resolve()), where).replace(str(tmp), where)
        raise ExportError(message) from exc.__cause__


def _graphs(graph: onnx.GraphProto) -> list[onnx.GraphProto]:
    out = [graph]
    for n in graph.node:
        for a in n.attribute:
            for g in ([a.g] if a.HasField("g") else []) + list(a.graphs):
                out.extend(_graphs(g))
    return out


def _fp32_bytes(qgraph: Any) -> int:
    """Serialized size of the cleaned-up FP32 model (exporters that build no QDQ model)."""
    from netquant.graph import to_onnx

    return to_onnx(unwrap(qgraph).graph, check=False).ByteSize()
