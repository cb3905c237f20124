"""FP32 vs INT8, measured in the target engine.

Every exported model file runs in its engine on the validation batches (export.validate), and those outputs are
compared here with the user's FP32 model run in onnxruntime on the same batches: per output the cosine and the
largest absolute error, and where the output looks like class scores the share of positions whose top-1 class is
FP32's. Where the engine is onnxruntime on this machine, both files are also timed: on the input shapes placement
timed (its first calibration sample; placement's own timing of the same two files is reused where it has one), else
at the calibration batch size.

A file whose engine output is catastrophically far from FP32 (`check_vs_fp32`: an output's cosine below
DEFAULT_MIN_COSINE) is refused like a validation failure. The default comes from measurements (benchmarks/fidelity.py,
results/fidelity.md; AMD EPYC, 2 cores shared; onnxruntime; default settings; output cosine vs FP32 over the
validation batches, rendered text lines for PP-OCR):

    sound files:  PP-OCRv4 rec 0.98882 (softmax over 6,625 classes; top-1 agreement 97.6%), PP-OCR cls 0.99974,
                  6-layer encoder 0.99988; light alexnet / shufflenet / squeezenet 1.00000 (random inputs saturate
                  their softmax); the README's rec table in SNR terms (cosine ~ 1 / sqrt(1 + 10^(-SNR/10))):
                  pair-limited int8 16.2 dB ~ 0.988 (97.75% lines), int7 14.5 dB ~ 0.983 (97.0%),
                  uint8 15.2 dB ~ 0.985 (98.75%);
    broken files: full-range int8 run by onnxruntime's saturating kernels on AVX2 11.2 dB ~ 0.964 (86.25% lines),
                  weights x1e-6 under the old eps scale floor 0.966 (issue 19), an all-zero output 0.0.

0.97 lies between the worst sound file (0.983) and the best broken one (0.966), near 1 - 1.5 x placement's default
budget (balanced: fake-quant 1 - cosine <= 0.02, and validation lets the engine lose 1.5x the fake-quant's loss). Lower it (quantize_onnx(min_cosine=...), `--min-cosine`) for a model known to lose more
(4-bit schemes without a budget, objective None on a sensitive model).
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import onnx

from netquant.errors import ExportError
from netquant.passes.quant_graph import QuantizedGraph

DEFAULT_MIN_COSINE = 0.97  # output cosine vs FP32 below which an export is refused (module docstring)
CLASS_SCORE_PRODUCERS = frozenset({"Softmax", "LogSoftmax"})  # rank >= 3 outputs with these producers: class scores
TIMING_ROUNDS, MIN_TIMING_ROUNDS = 5, 3  # interleaved rounds (one run of each file per round), median ...
TIMING_BUDGET_S = 0.5  # ... fewer rounds (at least MIN_TIMING_ROUNDS) when 5 would take longer than this


@dataclass(frozen=True)
class OutputComparison:
    """One output of the exported file in its engine vs the FP32 model in onnxruntime, over all compared batches.

    cosine: of the flattened outputs (float64); max_abs_err: max |engine - FP32|; top1_agreement: the share of
    positions (all but the last axis) whose argmax over the last axis equals FP32's, where the output looks like class
    scores (2-D [N, C] with C > 1, or a Softmax / LogSoftmax output with C > 1), else None. Integer outputs: cosine is
    the share of equal elements.
    """

    name: str
    cosine: float
    max_abs_err: float
    top1_agreement: float | None = None
    top1_positions: int = 0
    shape: tuple[int, ...] = ()  # the FP32 output's shape on the first batch

    def words(self) -> str:
        top1 = f", top-1 agreement {100 * self.top1_agreement:.1f}%" if self.top1_agreement is not None else ""
        return f"cosine {self.cosine:.5f}, max err {self.max_abs_err:.3g}{top1}"


@dataclass
class EngineComparison:
    """FP32 vs INT8 of one exported file: every output (OutputComparison) and, where timed, the latency of both.

    int8_ms / fp32_ms: medians of `timing_rounds` interleaved runs of one batch of `timed_batch` samples (onnxruntime
    CPU sessions with default threads, the ones validation ran); None where the engine is not timed here.
    """

    engine: str  # the engine that ran the exported file ("onnxruntime", "OpenVINO", "LiteRT", "ncnn", ...)
    reference: str  # what FP32 is: the source model (or the cleaned-up graph) in onnxruntime
    outputs: list[OutputComparison] = field(default_factory=list)
    batches: int = 0
    samples: int = 0
    data: str = "calibration batches"  # which batches: the kept calibration batches, or the export's `sample`
    int8_ms: float | None = None
    fp32_ms: float | None = None
    timed_batch: int | None = None
    timing_rounds: int = 0
    timed_by: str = ""  # "": timed here; "placement": placement's whole-model timing of the same two files reused
    seconds: float = 0.0  # what the comparison and the timing cost (the FP32 session, its runs, the timed runs)

    @property
    def speedup(self) -> float | None:
        """FP32 time / INT8 time (None: not timed)."""
        if self.int8_ms is None or self.fp32_ms is None or self.int8_ms <= 0:
            return None
        return self.fp32_ms / self.int8_ms

    @property
    def min_cosine(self) -> float:
        return min((o.cosine for o in self.outputs), default=1.0)

    def speed_words(self) -> str:
        s = self.speedup
        if s is None:
            return ""
        return f"{s:.2f}x faster" if s >= 1 else f"{1 / s:.2f}x slower"

    def line(self, float_file: bool = False) -> str:
        """'INT8 vs FP32 in onnxruntime: cosine 0.99987, max err 0.012, top-1 agreement 99.5%, 1.53x faster' (one
        output; several: each named). float_file: the file has no INT8 region (the speed is graph clean-up's)."""
        what = "float file vs FP32" if float_file else "INT8 vs FP32"
        if len(self.outputs) == 1:
            body = self.outputs[0].words()
        else:
            body = "; ".join(f"{o.name}: {o.words()}" for o in self.outputs)
        speed = self.speed_words()
        if speed:
            speed += (f" (batch {self.timed_batch}, median of {self.timing_rounds})" if not self.timed_by else
                      f" (batch {self.timed_batch}, one thread, timed by {self.timed_by})")
            if float_file:
                speed += ": no INT8 region, a gain from graph clean-up alone"
        return f"{what} in {self.engine}: {body}{', ' + speed if speed else ''} ({self.samples} samples of the {self.data})"

    def markdown(self) -> str:
        """The report's 'FP32 vs INT8' section: what was compared, then one bullet per output."""
        how = (f"median of {self.timing_rounds} interleaved rounds" if not self.timed_by else
               f"one thread, timed by {self.timed_by}")
        timing = (f"; timed at batch {self.timed_batch}, {how}: "
                  f"{self.int8_ms:.2f} ms vs {self.fp32_ms:.2f} ms FP32, {self.speed_words()}"
                  if self.speedup is not None else "; speed not measured for this engine here")
        lines = [f"{self.samples} samples of the {self.data}; FP32: {self.reference}{timing}.", ""]
        lines += [f"- `{o.name}`: {o.words()}" for o in self.outputs]
        return "\n".join(lines) + "\n"

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["speedup"] = self.speedup
        d["outputs"] = [{**asdict(o), "shape": list(o.shape)} for o in self.outputs]
        return d


def is_class_scores(shape: tuple[int, ...], producer: str | None) -> bool:
    """2-D [N, C] with C > 1, or rank >= 3 with C > 1 on the last axis produced by Softmax / LogSoftmax."""
    if len(shape) < 2 or shape[-1] <= 1:
        return False
    return len(shape) == 2 or producer in CLASS_SCORE_PRODUCERS


def compare_output(name: str, engine: Sequence[np.ndarray], fp32: Sequence[np.ndarray],
                   producer: str | None = None) -> OutputComparison:
    """OutputComparison of one output from per-batch engine and FP32 arrays (an engine array with FP32's element
    count but another shape, e.g. ncnn's [N, -1], is reshaped to FP32's)."""
    eng = [np.asarray(e).reshape(f.shape) if np.asarray(e).size == f.size else np.asarray(e)
           for e, f in zip(engine, fp32)]
    for e, f in zip(eng, fp32):
        if e.shape != f.shape:
            raise ExportError(f"output '{name}' has shape {e.shape} in the engine but {f.shape} in the FP32 model")
    y = np.concatenate([e.ravel() for e in eng]).astype(np.float64)
    r = np.concatenate([f.ravel() for f in fp32]).astype(np.float64)
    err = float(np.abs(y - r).max(initial=0.0))
    if not np.issubdtype(np.asarray(fp32[0]).dtype, np.floating):
        return OutputComparison(name, float(np.mean(y == r)) if y.size else 1.0, err, shape=tuple(fp32[0].shape))
    from netquant.export.validate import cosine

    top1, positions = None, 0
    if is_class_scores(tuple(fp32[0].shape), producer):
        hits = [np.argmax(e, axis=-1) == np.argmax(f, axis=-1) for e, f in zip(eng, fp32)]
        positions = sum(h.size for h in hits)
        top1 = float(sum(h.sum() for h in hits) / max(positions, 1))
    return OutputComparison(name, cosine(y, r), err, top1, positions, tuple(int(d) for d in fp32[0].shape))


# ---- the FP32 reference in onnxruntime --------------------------------------------------------------

@dataclass
class _Reference:
    key: tuple[Any, ...]
    session: Any
    label: str


_REFERENCES: weakref.WeakKeyDictionary[Any, _Reference] = weakref.WeakKeyDictionary()


def _cleaned_fp32(qgraph: QuantizedGraph) -> onnx.ModelProto:
    """The cleaned-up FP32 graph as ONNX with the FP32 biases (bias correction's rewrites undone), at the lowest IR
    version its opsets need (as the exported file: a source written at a newer IR than this onnxruntime knows)."""
    from onnx import numpy_helper

    from netquant.export.onnx_qdq import fp32_onnx
    from netquant.export.opset import lower_ir_version

    model = onnx.ModelProto()
    model.CopyFrom(fp32_onnx(qgraph))
    lower_ir_version(model)
    if qgraph.bias_corrections:
        for t in model.graph.initializer:
            bc = qgraph.bias_corrections.get(t.name)
            if bc is not None:
                t.CopyFrom(numpy_helper.from_array(bc.original.detach().cpu().numpy(), t.name))
    return model


def fp32_reference(qgraph: QuantizedGraph, source: bool = True, timed: bool = True) -> tuple[Any, str]:
    """(onnxruntime session, what it is) of the FP32 model: the user's source model (QuantizedGraph.fp32_source) where
    it loads in onnxruntime and `source`, else the cleaned-up graph with its FP32 biases. Memoised per quantized
    graph; placement's session of the source (QuantizedGraph.fp32_session) is reused where it is for that model
    object and either has the threads ort_session would give it (the thread_scope's) or the session is not `timed`
    (its outputs only are read: the thread count changes their speed, not their values)."""
    from netquant.export.validate import ort_session
    from netquant.passes.calibration import graph_state
    from netquant.platforms.threads import scoped_threads

    model = getattr(qgraph, "fp32_source", None) if source else None
    key = (graph_state(qgraph.graph), id(model), scoped_threads() if timed else None)
    ref = _REFERENCES.get(qgraph)
    if ref is not None and ref.key[:2] == key[:2] and (not timed or ref.key == key):
        return ref.session, ref.label
    session, label = None, ""
    held = getattr(qgraph, "fp32_session", None)
    if model is not None and held is not None and held.model is model and \
            (held.threads == scoped_threads() or not timed):
        session, label = held.session, "the source FP32 model"  # placement's session of the same model
    elif model is not None:
        try:
            session, label = ort_session(model, "FP32 source model"), "the source FP32 model"
        except (ExportError, ValueError):
            session = None
    if session is None:
        session = ort_session(_cleaned_fp32(qgraph), "FP32 model")
        label = "the cleaned-up FP32 graph"
    _REFERENCES[qgraph] = _Reference(key, session, label + " in onnxruntime")
    return session, label + " in onnxruntime"


def _producers(qgraph: QuantizedGraph) -> dict[str, str]:
    return {o: n.op_type for n in qgraph.graph.nodes for o in n.outputs if o}


def compare_with_fp32(qgraph: QuantizedGraph, engine_outputs: Mapping[str, Sequence[np.ndarray]],
                      batches: Sequence[Mapping[str, np.ndarray]], engine: str, *, sample_given: bool = False,
                      int8_session: Any = None) -> EngineComparison:
    """EngineComparison of the engine's outputs (per output name, one array per batch of `batches`) against the FP32
    model (fp32_reference) run on the same batches. Outputs the FP32 model lacks are skipped. sample_given: the batches
    are the export's `sample` (possibly held out), not the kept calibration batches.

    int8_session: the exported file's onnxruntime session (it has run `batches`): both files are then timed. Where
    placement timed on a cut of the first batch (QuantizedGraph.timed_shapes: its first sample), on that cut
    (_time_pair; placement's own timing of these two files reused where it has one: _placement_timing); else the
    FP32 runs the comparison needs are the timed ones: after one warm-up run, interleaved rounds (one run of each file
    on the same batch) over the batches shaped like the first, repeated to at least MIN_TIMING_ROUNDS (TIMING_ROUNDS
    within TIMING_BUDGET_S), median of each."""
    start = time.perf_counter()
    try:
        comparison = _compare(qgraph, engine_outputs, batches, engine, sample_given, int8_session, source=True)
    except ExportError:  # the source model does not run these batches in onnxruntime: the cleaned-up graph does
        comparison = None
    if comparison is None or not comparison.outputs:  # ... or its outputs are not the file's
        comparison = _compare(qgraph, engine_outputs, batches, engine, sample_given, int8_session, source=False)
    comparison.seconds = time.perf_counter() - start
    return comparison


def _compare(qgraph: QuantizedGraph, engine_outputs: Mapping[str, Sequence[np.ndarray]],
             batches: Sequence[Mapping[str, np.ndarray]], engine: str, sample_given: bool, int8_session: Any,
             source: bool) -> EngineComparison:
    timing_feeds = _timing_feeds(qgraph, batches[0]) if int8_session is not None and batches else {}
    reused = _placement_timing(qgraph, timing_feeds) if timing_feeds and source else None
    sess, label = fp32_reference(qgraph, source, timed=int8_session is not None and reused is None)
    if not label.startswith("the source"):
        reused = None  # placement timed the source model, not this one
    names = [o.name for o in sess.get_outputs()]
    wanted = {i.name for i in sess.get_inputs()}
    feeds = [{k: v for k, v in b.items() if k in wanted} for b in batches]

    held = getattr(qgraph, "fp32_session", None)
    placement_run = held.model if held is not None and held.session is sess else None  # placement's own session

    def run(i: int) -> list[np.ndarray]:
        if placement_run is not None:
            known = qgraph.engine_outputs(placement_run, feeds[i], held.threads)  # its warm-up run of this batch
            if known is not None:
                return known
        try:
            return sess.run(None, feeds[i])
        except Exception as exc:
            raise ExportError(f"the FP32 model ({label}) fails on a validation batch: {exc}") from exc

    got: dict[int, list[np.ndarray]] = {}
    t8: list[float] = []
    t32: list[float] = []
    cut = any(np.shape(v) != np.shape(batches[0][k]) for k, v in timing_feeds.items())
    if timing_feeds and reused is None and cut:  # placement's shapes: both files timed there, apart from the
        # comparison's runs on the whole batches
        t8, t32 = _time_pair(int8_session, sess, timing_feeds, label)
    elif int8_session is not None and batches and reused is None:
        f8 = [{k: v for k, v in b.items() if k in {i.name for i in int8_session.get_inputs()}} for b in batches]
        shape0 = {k: v.shape for k, v in batches[0].items()}
        same = [i for i, b in enumerate(batches) if {k: v.shape for k, v in b.items()} == shape0]
        got[0] = run(0)  # warm-up (the int8 session ran every batch in validation)
        order, n = list(same), 0
        while n < len(order):
            i = order[n]
            t = time.perf_counter()
            int8_session.run(None, f8[i])
            t8.append(1e3 * (time.perf_counter() - t))
            t = time.perf_counter()
            got[i] = run(i)
            t32.append(1e3 * (time.perf_counter() - t))
            if n == 0:
                fit = int(TIMING_BUDGET_S * 1e3 / max(t8[0] + t32[0], 1e-6))
                rounds = max(MIN_TIMING_ROUNDS, len(same), min(TIMING_ROUNDS, fit))
                order += [same[k % len(same)] for k in range(len(order), rounds)]
            n += 1
    for i in range(len(batches)):
        if i not in got:
            got[i] = run(i)
    fp32 = {n: [got[i][k] for i in range(len(batches))] for k, n in enumerate(names)}
    producers = _producers(qgraph)
    outputs = [compare_output(n, engine_outputs[n], fp32[n], producers.get(n)) for n in names
               if n in engine_outputs and len(engine_outputs[n]) == len(batches)]
    samples = sum(int(next(iter(b.values())).shape[0]) if b and next(iter(b.values())).ndim else 1 for b in batches)
    comparison = EngineComparison(engine=engine, reference=label, outputs=outputs, batches=len(batches),
                                  samples=samples, data="export's sample batch" if sample_given else "calibration batches")
    if reused is not None:
        comparison.int8_ms, comparison.fp32_ms = reused.int8_ms, reused.fp32_ms
        shape = next(iter(reused.shapes.values()), ())
        comparison.timed_batch = int(shape[0]) if shape else 1
        comparison.timed_by = "placement"
    elif t8:
        first = next(iter((timing_feeds or batches[0]).values()), None)
        comparison.int8_ms, comparison.fp32_ms = statistics.median(t8), statistics.median(t32)
        comparison.timed_batch = int(first.shape[0]) if first is not None and first.ndim else 1
        comparison.timing_rounds = len(t8)
    return comparison


def _timing_feeds(qgraph: QuantizedGraph, batch: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The feeds both files are timed on: `batch` (the first compared batch) cut along dim 0 to the shapes placement
    timed (QuantizedGraph.timed_shapes: its first calibration sample) where every input is such a cut of it; else
    `batch` whole (no placement timing, or a sample of other shapes)."""
    shapes = qgraph.timed_shapes
    if not shapes:
        return dict(batch)
    out = {}
    for k, v in batch.items():
        shape = shapes.get(k)
        x = np.asarray(v)
        if shape is None or x.ndim != len(shape) or (x.ndim and (x.shape[1:] != shape[1:] or shape[0] > x.shape[0])):
            return dict(batch)
        out[k] = x[:shape[0]] if x.ndim else x
    return out


def _time_pair(int8_session: Any, fp32_session: Any, feeds: Mapping[str, np.ndarray], label: str
               ) -> tuple[list[float], list[float]]:
    """ms of one run of the INT8 and the FP32 file on `feeds`: one warm-up run of each, then interleaved rounds (one
    run of each per round), MIN_TIMING_ROUNDS or more (TIMING_ROUNDS within TIMING_BUDGET_S)."""
    f8 = {k: v for k, v in feeds.items() if k in {i.name for i in int8_session.get_inputs()}}
    f32 = {k: v for k, v in feeds.items() if k in {i.name for i in fp32_session.get_inputs()}}
    try:
        int8_session.run(None, f8)  # warm-up: neither ran these shapes in export yet
        fp32_session.run(None, f32)
        t8: list[float] = []
        t32: list[float] = []
        rounds = MIN_TIMING_ROUNDS
        while len(t8) < rounds:
            t = time.perf_counter()
            int8_session.run(None, f8)
            t8.append(1e3 * (time.perf_counter() - t))
            t = time.perf_counter()
            fp32_session.run(None, f32)
            t32.append(1e3 * (time.perf_counter() - t))
            if len(t8) == 1:
                fit = int(TIMING_BUDGET_S * 1e3 / max(t8[0] + t32[0], 1e-6))
                rounds = max(MIN_TIMING_ROUNDS, min(TIMING_ROUNDS, fit))
    except Exception as exc:
        raise ExportError(f"the FP32 model ({label}) or the exported file fails on the timing batch (the shapes "
                          f"placement timed: the first calibration batch cut to one sample along dim 0): {exc}. "
                          "If the model needs its whole batch, name its dim 0 other than a batch axis (e.g. 'frames') "
                          "so that placement and export time the calibration batch whole.") from exc
    return t8, t32


def _placement_timing(qgraph: QuantizedGraph, feeds: Mapping[str, np.ndarray]) -> Any:
    """Placement's whole-model timing (QuantizedGraph.whole_model_timing) where it timed these two files on feeds
    shaped like `feeds` (the timing feeds here); else None (the files are timed here)."""
    from netquant.export.onnx_qdq import quant_state

    timing = qgraph.whole_model_timing
    if timing is None or not feeds:
        return None
    if {k: tuple(np.shape(v)) for k, v in feeds.items() if k in timing.shapes} != timing.shapes:
        return None
    return timing if quant_state(qgraph) == timing.state else None


def confirmed_vs_fp32(qgraph: QuantizedGraph, comparison: EngineComparison, engine_outputs: Mapping[str, Sequence[Any]],
                      batches: Sequence[Mapping[str, np.ndarray]], int8_session: Any,
                      min_cosine: float | None, where: str) -> EngineComparison:
    """`comparison` where no output's cosine vs FP32 is under min_cosine (or there is no check, or no calibration
    batches kept after `batches`); else the comparison over `batches` and those later batches
    (QuantizedGraph.confirmation_batches, run in `int8_session`), with the first comparison's timing: a refusal is
    confirmed on them, as export.validate.compare_with_executor confirms its own (PP-OCRv6 rec all INT8: cosine 0.968
    over 3 samples of one line each, 0.984 over 24, 99% of held-out lines read as FP32 reads them)."""
    if min_cosine is None or comparison.min_cosine >= min_cosine or not qgraph.confirmation_batches:
        return comparison
    from netquant.export.validate import run_ort, sample_feeds

    more = [sample_feeds(qgraph, b) for b in qgraph.confirmation_batches]
    names = [o.name for o in int8_session.get_outputs()]
    outputs = {k: list(v) for k, v in engine_outputs.items()}
    for feeds in more:
        for name, y in zip(names, run_ort(int8_session, feeds, where)):
            if name in outputs:
                outputs[name].append(y)
    wider = compare_with_fp32(qgraph, outputs, [*batches, *more], comparison.engine)
    return replace(wider, int8_ms=comparison.int8_ms, fp32_ms=comparison.fp32_ms, timed_batch=comparison.timed_batch,
                   timing_rounds=comparison.timing_rounds, timed_by=comparison.timed_by,
                   seconds=comparison.seconds + wider.seconds)


def check_vs_fp32(comparison: EngineComparison | None, min_cosine: float | None, where: str) -> None:
    """ExportError naming every output whose cosine vs FP32 is below min_cosine (None: no check)."""
    if comparison is None or min_cosine is None:
        return
    bad = [o for o in comparison.outputs if o.cosine < min_cosine]
    if bad:
        detail = "; ".join(f"output '{o.name}': {o.words()}" for o in bad)
        raise ExportError(
            f"exported model for '{where}' loses too much against FP32 in {comparison.engine} over "
            f"{comparison.samples} sample(s) ({detail}; min_cosine {min_cosine}): the quantized model is broken for "
            "these inputs (tiny weights or activations, or a model that does not survive 8 bits). Check the "
            "calibration data, keep the layers named by layer_report in float (force_fp32 / --fp32-ops), or lower the "
            "threshold (quantize_onnx(min_cosine=...) / --min-cosine) to write it anyway. No file written.")
