"""Transformer encoders (issue 21): netquant's default vs onnxruntime's quantize_dynamic / quantize_static and NNCF,
six encoders x three graph forms, batch 1 and batch 8 at sequence 128, one command.

Encoders and forms: benchmarks/transformer_models.py (BERT-base, DistilBERT, MiniLM-like 6x384, ViT-B/16-like,
Whisper-encoder-like with its conv front end, the fused-QKV style of zoo.bert_module; TorchScript export, dynamo
export, and the TorchScript file after onnxruntime.transformers.optimizer). Random (seeded) weights: output cosine vs
FP32 is the metric.

Methods: FP32 (the source file), netquant default (quantize_onnx, objective balanced, onnxruntime_int8), ORT
quantize_dynamic (per_channel, QInt8 weights, reduce_range True and False), ORT quantize_static (QDQ, per-channel,
MinMax, QUInt8 activations, after quant_pre_process) and NNCF (nncf.quantize, model_type TRANSFORMER) where it imports.
Calibration: --calib batch-1 samples. Cosine: over --eval batch-1 samples and one batch of 8. Latency: one
onnxruntime thread, every method of a model interleaved round by round, the order rotating (medians), at batch 1
and batch 8, rounds added while netquant's latency verdict is split or a near miss (settled_latency); speed = FP32
latency / method latency. Cosine on x86 without VNNI: batch 1, each file's onnxruntime-optimized graph on netquant's
executor with pairwise-int16 accumulation (cosine_without_vnni). Quantization time: quantize (+ export with its
validation for netquant) wall seconds, every method's Python modules imported before the first is timed
(warm_imports: no method pays a one-time import), each method run twice in two passes, then netquant and ORT static
alternating while close (quantize_all), each run after an untimed garbage collection: the median of the runs after
the first reported, every run beside it. Targets (the results file's first section): each model against issue 21's
targets, the latency one as netquant's time over the fastest ORT recipe within 0.5% of FP32's cosine and
quantization time over ORT static's, each read two ways, by medians and by fastest runs (met, split or missed:
Verdict; every run's time is written beside the results file, RESULTS with suffix .runs.json; --targets recomputes
the section from them).

    python benchmarks/transformer_encoders.py [--models minilm,fused_qkv,whisper,distilbert,vit,bert_base]
        [--forms torchscript,dynamo,ortopt] [--calib 16] [--eval 4] [--budget-min 90]

Writes benchmarks/results/transformers.md after every model (what did not run within --budget-min is listed).
"""

from __future__ import annotations

import argparse
import enum
import functools
import gc
import json
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).parent))
import transformer_models as tm  # noqa: E402
from netquant.analysis.timing import InterleavedTimes, interleaved_times  # noqa: E402
from netquant.atomic import write_text_atomic  # noqa: E402
from netquant.export.ort_kernels import ort_int8_kernels  # noqa: E402
from netquant.platforms.targets import host_info  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "transformers.md"
MODELS_DIR = Path(tempfile.gettempdir()) / "netquant_transformer_models"
Feeds = dict[str, np.ndarray]
BATCHES = (1, 8)
EMULATION_SHARE = 0.1  # the executor (exact) must give onnxruntime's accuracy here within this share of the error


@dataclass
class Case:
    name: str
    path: Path
    calib: list[Feeds]
    evals: dict[int, list[Feeds]]  # batch size -> evaluation batches


@dataclass
class Result:
    method: str
    path: Path | None = None
    note: str = ""
    quant_runs_s: list[float] = field(default_factory=list)  # every quantization run in this process, in order
    cosine_no_vnni: float | None = None  # batch 1, emulated as x86 without VNNI runs it (cosine_without_vnni)
    cosine: dict[int, float] = field(default_factory=dict)
    speed: dict[int, float] = field(default_factory=dict)
    rounds_ms: dict[int, tuple[tuple[float, ...], ...]] = field(default_factory=dict)  # batch -> its runs by round
    kernels: str = ""

    @property
    def ms(self) -> dict[int, float]:
        """batch -> the median of its timed runs."""
        return {b: InterleavedTimes((runs,)).median_ms()[0] for b, runs in self.rounds_ms.items()}

    @property
    def later_quant_runs_s(self) -> list[float]:
        """The runs after the first (order-independent: see quantize_all); the one run where there is one."""
        return self.quant_runs_s[1:] or self.quant_runs_s

    @property
    def quant_s(self) -> float | None:
        """The median of the runs after the first."""
        return statistics.median(self.later_quant_runs_s) if self.quant_runs_s else None

    @property
    def quant_fastest_s(self) -> float | None:
        """The fastest run after the first."""
        return min(self.later_quant_runs_s, default=None)


def session(path: Path, threads: int = 1) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def make_case(key: str, form: str, n_calib: int, n_eval: int) -> Case:
    enc = tm.ENCODERS[key]
    path = tm.export(enc, form, MODELS_DIR)
    return Case(f"{enc.title}, {form}", path, [enc.inputs(1, i) for i in range(n_calib)],
                {1: [enc.inputs(1, 1000 + i) for i in range(n_eval)], 8: [enc.inputs(8, 2000)]})


# ---- methods: each writes `out` and returns a note -------------------------------------------------------------
def netquant_default(case: Case, out: Path) -> str:
    import netquant

    qm = netquant.quantize_onnx(str(case.path), case.calib, quiet=True)
    qm.export(out)
    p = qm.placement
    if p is None:
        return ""
    s = p.summary()
    return (f"placement: {s['int8_regions']} int8 (static), {s['dynamic_regions']} dynamic, {s['float_regions']} "
            "float regions" + (f", {s['weight_only_regions']} weight-only" if s.get("weight_only_regions") else ""))


def ort_dynamic(reduce_range: bool) -> Callable[[Case, Path], str]:
    def run(case: Case, out: Path) -> str:
        from onnxruntime.quantization import QuantType, quantize_dynamic

        # DefaultTensorType: the workaround ORT's own error message gives for graphs with com.microsoft ops (the
        # optimizer's fused form), whose outputs onnx shape inference leaves untyped
        quantize_dynamic(str(case.path), str(out), per_channel=True, reduce_range=reduce_range,
                         weight_type=QuantType.QInt8, extra_options={"DefaultTensorType": onnx.TensorProto.FLOAT})
        return ""

    return run


class _Reader:
    def __init__(self, batches: list[Feeds]) -> None:
        self.batches, self.i = batches, 0

    def get_next(self) -> Feeds | None:
        self.i += 1
        return self.batches[self.i - 1] if self.i <= len(self.batches) else None

    def rewind(self) -> None:
        self.i = 0


def ort_static(case: Case, out: Path) -> str:
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    pre = out.parent / f"{out.stem}.pre.onnx"
    note = ""
    cwd = os.getcwd()
    os.chdir(out.parent)
    try:
        try:
            quant_pre_process(str(case.path), str(pre))
        except Exception:  # noqa: BLE001 - its symbolic shape inference asserts on some models (documented fallback)
            quant_pre_process(str(case.path), str(pre), skip_symbolic_shape=True)
            note = "quant_pre_process needed skip_symbolic_shape=True"
        quantize_static(str(pre), str(out), _Reader(case.calib), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                        calibrate_method=CalibrationMethod.MinMax)
    finally:
        os.chdir(cwd)
    return note


def nncf_transformer(case: Case, out: Path) -> str:
    import nncf

    model = onnx.load(str(case.path))
    q = nncf.quantize(model, nncf.Dataset(case.calib), model_type=nncf.ModelType.TRANSFORMER,
                      subset_size=len(case.calib))
    onnx.save(q, str(out))
    return ""


def warm_imports() -> None:
    """Import every method's modules once, before any is timed: quantization time is the work, not Python's first
    import of a package (about a second for netquant.api or onnxruntime.quantization, more under load)."""
    import onnxruntime.quantization  # noqa: F401
    import onnxruntime.quantization.shape_inference  # noqa: F401

    import netquant.api  # noqa: F401


STATIC = "ORT quantize_static QDQ per-channel MinMax"


def methods() -> list[tuple[str, Callable[[Case, Path], str]]]:
    out: list[tuple[str, Callable[[Case, Path], str]]] = [
        ("netquant default", netquant_default),
        ("ORT quantize_dynamic per-channel, reduce_range", ort_dynamic(True)),
        ("ORT quantize_dynamic per-channel", ort_dynamic(False)),
        (STATIC, ort_static),
    ]
    try:
        import nncf  # noqa: F401
    except ImportError:
        return out
    return [*out, ("NNCF model_type=TRANSFORMER", nncf_transformer)]


# ---- measuring ------------------------------------------------------------------------------------------------------
def cosine_vs(ref: list[np.ndarray], out: list[np.ndarray]) -> float:
    a = np.concatenate([r.ravel() for r in ref]).astype(np.float64)
    b = np.concatenate([r.ravel() for r in out]).astype(np.float64)
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-300))


def clear_process_caches() -> None:
    """Drop netquant's per-process probe caches (onnxruntime's SkipLayerNormalization timing, the host's int8
    accumulation, hard-swish value floors), so a second timed run pays what a fresh process pays."""
    from netquant.passes.value_floors import stationary_floor
    from netquant.platforms.ort_probes import skip_layer_norm_probe
    from netquant.platforms.targets import host_accumulation

    for cached in (skip_layer_norm_probe, host_accumulation, stationary_floor):
        cached.cache_clear()


QUANT_CLOSE = (0.85, 1.15)  # netquant / ORT static quantization time within this: more passes of the two decide


def quantize_all(case: Case, work: Path, max_passes: int = 2) -> list[Result]:
    """Every method twice, in two passes over the list: the first run of a method in this process and its second
    (netquant's probe caches cleared), each after a garbage collection (untimed). Whichever method goes first in a
    model pays that model's first touch of memory; the later passes leave the order out of the times. Then, while
    netquant's and ORT static's medians of their later runs are close (QUANT_CLOSE), those two alternate further
    passes, up to `max_passes` runs each. The last pass's files are the ones measured."""
    by_label = dict(methods())
    results = [Result("FP32", case.path, note="source file")]
    for label in by_label:
        results.append(Result(label, work / f"{abs(hash((case.name, label)))}.onnx"))

    def run(r: Result) -> None:
        if r.path is None:
            return  # failed in an earlier pass
        try:
            seconds, r.note = timed_quantization(r.method, by_label[r.method], case, r.path)
        except Exception as exc:  # noqa: BLE001 - a peer failing is a result to report, not a crash
            traceback.print_exc()
            r.path, r.note = None, f"failed: {type(exc).__name__}: {str(exc)[:160]}"
            return
        r.quant_runs_s.append(seconds)

    for _ in range(2):
        for r in results[1:]:
            run(r)
    ours, static = (next(r for r in results if r.method == m) for m in ("netquant default", STATIC))
    while static.quant_s and ours.quant_s and len(ours.quant_runs_s) < max_passes and \
            QUANT_CLOSE[0] <= ours.quant_s / static.quant_s <= QUANT_CLOSE[1]:
        run(ours)
        run(static)
    return results


def timed_quantization(label: str, fn: Callable[[Case, Path], str], case: Case, out: Path) -> tuple[float, str]:
    """(wall seconds, note) of one method writing `out`: netquant's probe caches cleared first, after an untimed
    garbage collection (every method starts from a collected heap: no earlier method's unreachable cycles freed in
    its time), warnings silenced."""
    if label.startswith("netquant"):
        clear_process_caches()
    gc.collect()
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        note = fn(case, out)
    return time.perf_counter() - t, note


def cosine_without_vnni(path: Path, feeds: list[Feeds], ref: list[np.ndarray],
                        here: list[np.ndarray]) -> tuple[float | None, str]:
    """(cosine vs `ref`, note) of the file as x86 CPUs without VNNI run it: the graph onnxruntime runs here (its fused
    int8 kernels: MatMulIntegerToFloat, DynamicQuantizeMatMul, QAttention, QLinearMatMul, ...) on netquant's executor
    with pairwise-int16 accumulation (u8 x s8 pairs summed with int16 saturation, as vpmaddubsw does). The same
    executor with exact accumulation must first give the accuracy onnxruntime gives here (`here`: its outputs on
    `feeds`) to within EMULATION_SHARE of the file's own error (1 - cosine): deep int8 graphs follow float noise into
    other rounding choices, so the two engines' outputs differ element by element by about as much as each differs
    from FP32, while their error is the same (the note gives both cosines)."""
    from netquant.core.int_kernels import Accumulation
    from netquant.graph.executor import Executor
    from netquant.graph.load import load_onnx

    with tempfile.TemporaryDirectory(prefix="netquant_novnni_") as tmp:
        so = ort.SessionOptions()
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.intra_op_num_threads = 1
        so.log_severity_level = 3
        so.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        try:
            graph = load_onnx(so.optimized_model_filepath)
            out = graph.outputs[0].name

            def run(acc: Accumulation) -> list[np.ndarray]:
                ex = Executor(graph, accumulation=acc)
                return [ex.run({k: torch.from_numpy(v) for k, v in b.items()})[out].numpy() for b in feeds]

            exact = cosine_vs(ref, run(Accumulation.EXACT))
        except Exception as exc:  # noqa: BLE001 - an op the executor lacks: no emulated number
            return None, f"executor cannot run it: {type(exc).__name__}: {str(exc)[:80]}"
        engine = cosine_vs(ref, here)
        note = f"executor exact {exact:.6f} vs onnxruntime {engine:.6f}"
        if abs(exact - engine) > EMULATION_SHARE * (1 - engine):
            return None, note + f": apart by over {EMULATION_SHARE:.0%} of the error"
        return cosine_vs(ref, run(Accumulation.PAIRWISE_INT16)), note


@dataclass(frozen=True)
class Timing:
    """How the latency runs go: batch-1 rounds of `per_round` runs, batch-8 rounds of one run; each from its
    minimum number of rounds up to its maximum while netquant's verdict against the fastest ORT recipe within the
    metric is split or a near miss (settled_latency)."""

    per_round: int
    rounds: int
    rounds_max: int
    rounds_b8: int
    rounds_b8_max: int
    quant_passes: int  # quantize_all's max_passes

    def of(self, batch: int) -> tuple[int, int, int]:
        """(runs per round, minimum rounds, maximum rounds) at `batch`."""
        if batch == 1:
            return self.per_round, self.rounds, max(self.rounds, self.rounds_max)
        return 1, self.rounds_b8, max(self.rounds_b8, self.rounds_b8_max)


def settled_latency(ok: list[Result], batch: int) -> Callable[[InterleavedTimes], bool] | None:
    """settled for interleaved_times over the sessions of `ok` (FP32, netquant, the peers): the latency verdict
    (Targets.latency, from the runs so far) is met, or missed by more than CLEAR_MISS (a split verdict or a near miss
    takes more rounds). None when there is nothing to compare."""
    ours = next((i for i, r in enumerate(ok) if r.method == "netquant default"), None)
    peers = [i for i, r in enumerate(ok) if counts_for_latency(r.method, r.cosine, batch)]
    if ours is None or not peers:
        return None

    def settled(runs: InterleavedTimes) -> bool:
        medians, fastest = runs.median_ms(), runs.fastest_ms()
        ratios = (medians[ours] / min(medians[i] for i in peers), fastest[ours] / min(fastest[i] for i in peers))
        return read_two_ways(*ratios, 1 + LEVEL) is Verdict.MET or \
            read_two_ways(*ratios, 1 + LEVEL + CLEAR_MISS) is Verdict.MISSED

    return settled


def bench(case: Case, work: Path, timing: Timing) -> list[Result]:
    results = quantize_all(case, work, timing.quant_passes)
    ok = [r for r in results if r.path is not None]
    for r in ok:
        counts = ort_int8_kernels(r.path)
        r.kernels = ", ".join(f"{k} x{v}" for k, v in counts.items()) or "none"
    sessions = []
    for r in list(ok):
        try:
            sessions.append(session(r.path))  # type: ignore[arg-type]
        except Exception as exc:  # noqa: BLE001 - a file onnxruntime rejects is a result
            r.note = f"onnxruntime cannot load it: {str(exc)[:160]}"
            ok.remove(r)
    for batch, feeds in case.evals.items():
        outs = [[s.run(None, b)[0] for b in feeds] for s in sessions]
        for r, o in zip(ok, outs, strict=True):
            r.cosine[batch] = cosine_vs(outs[0], o)
            if batch == 1 and r is not ok[0]:
                r.cosine_no_vnni, why = cosine_without_vnni(r.path, feeds, outs[0], o)  # type: ignore[arg-type]
                r.note = "; ".join(filter(None, [r.note, f"no-VNNI emulation: {why}"]))
        per_round, least, most = timing.of(batch)
        runs = interleaved_times([functools.partial(s.run, None, feeds[0]) for s in sessions], per_round=per_round,
                                 rounds=most, min_rounds=least, settled=settled_latency(ok, batch),
                                 warmup=1 if batch > 1 else 3)
        ms = runs.median_ms()
        for r, m, by_round in zip(ok, ms, runs.runs_ms, strict=True):
            r.speed[batch], r.rounds_ms[batch] = ms[0] / m, by_round
        print(f"{case.name} batch {batch}: " + ", ".join(f"{r.method} {r.ms[batch]:.1f} ms" for r in ok),
              flush=True)
    return results


QUANT_HEAD = "quant s (median of runs 2+; every run)"
SPEED_TARGET = 1.3  # the default's FP32 / INT8 latency, every encoder, both batches
WITHIN_METRIC = 0.005  # a peer recipe counts for the latency target when its cosine is within this of FP32's (1.0)
LEVEL = 0.02  # "as fast as": netquant's time / the fastest such recipe's at most 1 + LEVEL
CLEAR_MISS = 0.03  # latency rounds stop early on a miss only where both readings are this far over 1 + LEVEL
SHORT = {"netquant default": "netquant", "ORT quantize_dynamic per-channel, reduce_range": "ORT dynamic rr",
         "ORT quantize_dynamic per-channel": "ORT dynamic", STATIC: "ORT static",
         "NNCF model_type=TRANSFORMER": "NNCF"}


class Verdict(enum.StrEnum):
    """A latency comparison read two ways (medians, fastest runs)."""

    MET = "met"  # both within 1 + LEVEL
    SPLIT = "split"  # one within, one not: closer than this host resolves in this run
    MISSED = "missed"  # both over


def counts_for_latency(method: str, cosine: dict[int, float], batch: int) -> bool:
    """An ORT recipe whose cosine at `batch` is within WITHIN_METRIC of FP32's: one the latency target compares."""
    return method.startswith("ORT") and cosine.get(batch, 0.0) >= 1.0 - WITHIN_METRIC


def read_two_ways(by_medians: float, by_fastest: float, at_most: float) -> Verdict:
    """A ratio (netquant / peer) read from medians and from fastest runs against `at_most`."""
    within = [by_medians <= at_most, by_fastest <= at_most]
    return Verdict.MET if all(within) else Verdict.MISSED if not any(within) else Verdict.SPLIT


def fastest_run(rounds: Sequence[Sequence[float]]) -> float:
    """The fastest single run of one file's rounds of runs (ms)."""
    return InterleavedTimes((tuple(map(tuple, rounds)),)).fastest_ms()[0]


@dataclass(frozen=True)
class Measured:
    """What the targets read of one method in one section."""

    method: str
    cosine: dict[int, float]
    median_ms: dict[int, float]
    fastest_ms: dict[int, float]
    size_mb: float | None
    quant_s: float | None  # the median of the runs after the first
    quant_fastest_s: float | None  # the fastest run after the first

    @classmethod
    def of(cls, r: Result) -> Measured:
        size = r.path.stat().st_size / 1e6 if r.path is not None and r.path.exists() else None
        return cls(r.method, dict(r.cosine), dict(r.ms),
                   {b: fastest_run(runs) for b, runs in r.rounds_ms.items()}, size, r.quant_s, r.quant_fastest_s)


@dataclass
class Targets:
    """One section against issue 21's targets (None: the peer failed or did not run, nothing to compare)."""

    speed: dict[int, float]  # batch -> FP32 / netquant, medians
    vs_median: dict[int, tuple[float, str]]  # batch -> (netquant / fastest ORT recipe within the metric, which), medians
    vs_fastest: dict[int, tuple[float, str]]  # the same from each file's fastest run
    size_mb: tuple[float | None, float | None]  # netquant, the smaller ORT quantize_dynamic file
    cosine_vs_nncf: tuple[float, float | None]  # netquant's lower cosine of batch 1 and 8, NNCF's
    quant_s: tuple[float | None, float | None]  # netquant, ORT static: medians of the runs after the first
    quant_fastest_s: tuple[float | None, float | None]  # the same, fastest runs after the first

    def fast_enough(self, batch: int) -> bool:
        return self.speed.get(batch, 0.0) >= SPEED_TARGET

    def latency(self, batch: int) -> Verdict:
        if batch not in self.vs_median:
            return Verdict.MET  # no ORT recipe within the metric: nothing to match
        return read_two_ways(self.vs_median[batch][0], self.vs_fastest[batch][0], 1 + LEVEL)

    def small_enough(self) -> bool:
        ours, peer = self.size_mb
        return peer is None or (ours is not None and ours <= peer)

    def as_accurate_as_nncf(self) -> bool:
        return self.cosine_vs_nncf[1] is None or self.cosine_vs_nncf[0] >= self.cosine_vs_nncf[1]

    def quick(self) -> Verdict:
        """Quantization time at most ORT static's, read by medians and by fastest runs (after the first)."""
        (ours, peer), (ours_fast, peer_fast) = self.quant_s, self.quant_fastest_s
        if ours is None or ours_fast is None:
            return Verdict.MISSED
        if peer is None or peer_fast is None:
            return Verdict.MET
        return read_two_ways(ours / peer, ours_fast / peer_fast, 1.0)


def targets(rows: list[Measured]) -> Targets | None:
    """The section's numbers against the targets (None when netquant's file failed)."""
    by = {r.method: r for r in rows}
    ours = by.get("netquant default")
    if ours is None or not ours.median_ms:
        return None
    vs_median: dict[int, tuple[float, str]] = {}
    vs_fastest: dict[int, tuple[float, str]] = {}
    for batch in ours.median_ms:
        peers = [r for r in rows if batch in r.median_ms and counts_for_latency(r.method, r.cosine, batch)]
        if not peers:
            continue
        for out, times in ((vs_median, lambda r: r.median_ms), (vs_fastest, lambda r: r.fastest_ms)):
            peer = min(peers, key=lambda r: times(r)[batch])  # noqa: B023 - used at once
            out[batch] = (times(ours)[batch] / times(peer)[batch], SHORT.get(peer.method, peer.method))
    dynamic = [r.size_mb for r in rows if r.method.startswith("ORT quantize_dynamic") and r.size_mb is not None]
    nncf = by.get("NNCF model_type=TRANSFORMER")
    nncf_cos = min(nncf.cosine.values()) if nncf is not None and nncf.cosine else None
    static = by.get(STATIC)
    return Targets({b: by["FP32"].median_ms[b] / ours.median_ms[b] for b in ours.median_ms}, vs_median, vs_fastest,
                   (ours.size_mb, min(dynamic, default=None)), (min(ours.cosine.values()), nncf_cos),
                   (ours.quant_s, static.quant_s if static is not None else None),
                   (ours.quant_fastest_s, static.quant_fastest_s if static is not None else None))


def render_targets(sections: list[tuple[str, list[Measured]]]) -> list[str]:
    """The '## Targets' section: one row per model section, then how many sections meet each target."""
    judged = [(name, t) for name, rows in sections if (t := targets(rows)) is not None]
    if not judged:
        return []
    batches = sorted({b for _, t in judged for b in t.speed})

    def mark(ok: bool) -> str:
        return "" if ok else " **missed**"

    head = ["section", *[f"speed b{b}" for b in batches],
            *[f"b{b}: netquant / fastest ORT recipe within {WITHIN_METRIC:.1%}: medians; fastest runs"
              for b in batches], "file MB: netquant / ORT dynamic", "cosine (lower of b1, b8): netquant / NNCF",
            "quant s: netquant / ORT static"]
    lines = ["## Targets", "",
             f"Issue 21's targets per section, from the tables below: speed >= {SPEED_TARGET}x FP32 (medians); as fast "
             f"as the fastest ORT recipe whose cosine is within {WITHIN_METRIC:.1%} of FP32's, read two ways: the "
             "ratio of medians, and the ratio of each file's fastest run (load only adds time to most runs, but "
             "single runs also come out fast; on a shared 2-core VM either moved by 5-10% between runs of one "
             f"file): **met** where both are at most {1 + LEVEL:.2f}, **missed** where both are over, **split** where "
             "they disagree (closer than this run resolves); every run's time is in the .runs.json file beside this "
             "one. File no larger than the smaller ORT quantize_dynamic file; cosine at least NNCF's (the lower of "
             "batch 1 and 8 each); quantization time at most ORT static MinMax's, read by the medians of the runs after "
             "each tool's first and by their fastest runs (met, split or missed as above, at 1.00).", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, t in judged:
        cells = [name, *[f"{t.speed[b]:.2f}x{mark(t.fast_enough(b))}" if b in t.speed else "-" for b in batches]]
        for b in batches:
            if b not in t.vs_median:
                cells.append("no ORT recipe within the metric")
                continue
            (med, med_peer), (fst, fst_peer) = t.vs_median[b], t.vs_fastest[b]
            verdict = t.latency(b)
            peers = med_peer if med_peer == fst_peer else f"{med_peer}; {fst_peer}"
            cells.append(f"{med:.3f}; {fst:.3f} vs {peers}" + ("" if verdict is Verdict.MET else f" **{verdict}**"))
        size, peer_size = t.size_mb
        cells.append(f"{'-' if size is None else f'{size:.2f}'} / {'-' if peer_size is None else f'{peer_size:.2f}'}"
                     f"{mark(t.small_enough())}")
        cos, nncf = t.cosine_vs_nncf
        cells.append(f"{cos:.5f} / {'NNCF failed' if nncf is None else f'{nncf:.5f}'}{mark(t.as_accurate_as_nncf())}")
        (q, q_peer), (qf, qf_peer) = t.quant_s, t.quant_fastest_s
        quick = t.quick()
        cells.append(("-" if q is None else f"{q:.1f}") + " / " + ("-" if q_peer is None else f"{q_peer:.1f}") +
                     ("" if q is None or q_peer is None or qf is None or qf_peer is None else
                      f" ({q / q_peer:.2f}x; fastest {qf / qf_peer:.2f}x)") +
                     ("" if quick is Verdict.MET else f" **{quick}**"))
        lines.append("| " + " | ".join(cells) + " |")
    n = len(judged)

    def count(ok: Callable[[Targets], bool]) -> int:
        return sum(ok(t) for _, t in judged)

    latency = ", ".join(f"b{b} met {count(lambda t, b=b: t.latency(b) is Verdict.MET)}, split "
                        f"{count(lambda t, b=b: t.latency(b) is Verdict.SPLIT)}, missed "
                        f"{count(lambda t, b=b: t.latency(b) is Verdict.MISSED)}" for b in batches)
    lines += ["", f"Of {n} sections: " + "; ".join(
        [f">= {SPEED_TARGET}x FP32 " + ", ".join(f"b{b} {count(lambda t, b=b: t.fast_enough(b))}" for b in batches),
         f"as fast as the fastest ORT recipe {latency}",
         f"file <= ORT dynamic {count(Targets.small_enough)}",
         f"cosine >= NNCF {count(Targets.as_accurate_as_nncf)} (NNCF ran on "
         f"{sum(t.cosine_vs_nncf[1] is not None for _, t in judged)})",
         "quantization time <= ORT static " + ", ".join(
             f"{v} {count(lambda t, v=v: t.quick() is v)}" for v in Verdict)]) + ".", ""]
    return lines


def _cell_float(cell: str) -> float | None:
    """The first number of a results-table cell ('4.6 (5.6)' -> 4.6, '1.63x' -> 1.63, '-' -> None)."""
    m = re.match(r"\s*(-?[0-9.]+)", cell)
    return float(m.group(1)) if m else None


def measured_from_results(text: str, runs: dict) -> list[tuple[str, list[Measured]]]:
    """Each section's Measured rows from a results file's tables (cosines, median ms, file MB, quant s) and its
    .runs.json (fastest runs): the Targets of a finished run, recomputed (--targets)."""
    _, sections = _sections(text)
    out: list[tuple[str, list[Measured]]] = []
    for title, lines in sections:
        table = [ln for ln in lines if ln.startswith("| ")]
        if title in ("Targets", "Not run") or not table or title not in runs:
            continue
        head = [c.strip() for c in table[0].strip("|").split("|")]
        rows = []
        for ln in table[1:]:
            cells = dict(zip(head, (c.strip() for c in ln.strip("|").split("|")), strict=False))
            method = cells["method"]
            times = runs[title].get(method, {})
            batches = [int(b) for b in times]
            rows.append(Measured(
                method, {b: v for b in batches if (v := _cell_float(cells.get(f"cosine b{b}", "-"))) is not None},
                {b: v for b in batches if (v := _cell_float(cells.get(f"ms b{b}", "-"))) is not None},
                {b: fastest_run(times[str(b)]) for b in batches},
                _cell_float(cells.get("file MB", "-")),
                *quant_times_of(cells, method)))
        out.append((title, rows))
    return out


def quant_times_of(cells: dict[str, str], method: str) -> tuple[float | None, float | None]:
    """(median, fastest) seconds of the runs after the first from a results row's quantization-time cell: 'm (a, b,
    c)' (every run) or, in files before the passes were repeated, 'second (first)' (one later run)."""
    if method == "FP32":
        return None, None
    if (cell := cells.get(QUANT_HEAD)) is not None:
        runs = [float(x) for x in re.findall(r"[0-9.]+", cell.split("(", 1)[1])] if "(" in cell else []
        return _cell_float(cell), min(runs[1:] or runs, default=None)
    second = _cell_float(cells.get("quant s (2nd run; 1st)", "-"))
    return second, second


def retarget(path: Path) -> str:
    """The results file at `path` with its Targets section recomputed from its tables and .runs.json."""
    text = path.read_text()
    sections = measured_from_results(text, json.loads(path.with_suffix(".runs.json").read_text()))
    head, parts = _sections(text)
    body = [ln for title, lines in parts if title != "Targets" for ln in lines]
    return "\n".join([*head, *render_targets(sections), *body]) + "\n"


def render(rows: list[tuple[Case, list[Result]]], args: argparse.Namespace, seconds: float, skipped: list[str],
           load: str) -> str:
    lines = ["# Transformer encoders: netquant default vs onnxruntime quantize_dynamic / quantize_static and NNCF", "",
             host_info(ort_threads=1).markdown(),
             f"onnxruntime {ort.__version__}; one run of `python benchmarks/transformer_encoders.py --models {args.models} "
             f"--forms {args.forms}{' --busy' if args.busy else ''}` ({seconds:.0f} s; "
             f"{'busy host: one spinning process per core started by the benchmark; ' if args.busy else ''}"
             f"load average {load}). Sequence {tm.SEQ} (ViT: {tm.VIT_IMAGE}x{tm.VIT_IMAGE} image, 122 tokens; "
             f"Whisper-like: {tm.WHISPER_FRAMES} mel frames -> {tm.SEQ} positions). Calibration: {args.calib} batch-1 "
             f"samples (token models: Zipf-like ids, padded rows); cosine vs the FP32 file in onnxruntime over "
             f"{args.eval} other batch-1 samples and one batch of 8. Latency: one onnxruntime intra-op thread, every "
             f"method of a model interleaved in rounds, the order rotating by round ({args.rounds} rounds of "
             f"{args.repeats} runs at batch 1, {args.rounds_b8} rounds of one run at batch 8; more, up to "
             f"{args.rounds_max} and {args.rounds_b8_max}, while netquant's verdict against the fastest ORT recipe "
             f"is split or missed by under {CLEAR_MISS:.0%}), medians; speed = FP32 / method. Cosine b1 x86 no VNNI: the same batch-1 samples through "
             "the graph onnxruntime runs here (its fused int8 kernels), on netquant's executor with pairwise-int16 "
             "accumulation, as CPUs without VNNI (AVX2, AVX-512 without VNNI) sum u8 x s8 pairs; the executor with "
             "exact accumulation first gives the accuracy onnxruntime gives here, to within a tenth of the file's "
             "own error (1 - cosine; both in the note). Quantization time: quantize "
             "(+ export with its validation for netquant), every method's modules imported before any is timed, "
             "every method run twice in two passes over the methods (netquant's probe caches cleared before each "
             "run), then netquant and ORT static alternating up to "
             f"{args.quant_passes_max} runs each while their times are within {QUANT_CLOSE[0]}-{QUANT_CLOSE[1]}x "
             "of each other, each run after an untimed garbage collection (no method frees an earlier one's "
             "unreachable objects in its time): the median of the runs after the first, every run in brackets (the "
             "first method of a model pays that model's first touch of memory). The machine (2 cores) is shared with other jobs: absolute "
             "times are noisy, ratios within one model and batch are the comparable numbers. Weights are random "
             "(seeded): cosine is the metric.", "",
             *render_targets([(case.name, [Measured.of(r) for r in results]) for case, results in rows])]
    for case, results in rows:
        bs = list(case.evals)
        head = ["method"] + [f"cosine b{b}" for b in bs] + ["cosine b1 x86 no VNNI (emulated)"] + \
            [f"ms b{b}" for b in bs] + [f"speed b{b}" for b in bs] + \
            ["file MB", QUANT_HEAD, "int8 kernels onnxruntime runs", "note"]
        lines += [f"## {case.name}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for r in results:
            size = f"{r.path.stat().st_size / 1e6:.2f}" if r.path is not None and r.path.exists() else "-"
            quant = "-" if r.quant_s is None else f"{r.quant_s:.1f} ({', '.join(f'{x:.1f}' for x in r.quant_runs_s)})"
            cells = [r.method] + [f"{r.cosine[b]:.5f}" if b in r.cosine else "-" for b in bs] + \
                ["1.00000" if r.method == "FP32" else "-" if r.cosine_no_vnni is None else f"{r.cosine_no_vnni:.5f}"] + \
                [f"{r.ms[b]:.1f}" if b in r.ms else "-" for b in bs] + \
                [f"{r.speed[b]:.2f}x" if b in r.speed else "-" for b in bs] + \
                [size, quant, r.kernels or "-", r.note.replace("|", "/")]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    if skipped:
        lines += ["## Not run", "", *[f"- {s}" for s in skipped], ""]
    return "\n".join(lines)


def runs_json(rows: list[tuple[Case, list[Result]]]) -> str:
    """Every timed run: {section: {method: {batch: [[ms of each run] per round]}}}, rounds in the order run."""
    return json.dumps({case.name: {r.method: {str(b): [[round(t, 3) for t in rnd] for rnd in runs]
                                              for b, runs in r.rounds_ms.items()}
                                   for r in results if r.rounds_ms} for case, results in rows}) + "\n"


def _sections(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """A results file as its header lines and its ('## title', lines) sections, in order."""
    header: list[str] = []
    sections: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith("## "):
            sections.append((line[3:], [line]))
        elif sections:
            sections[-1][1].append(line)
        else:
            header.append(line)
    return header, sections


RUN_PREFIX = "Run: "  # a merged section's first line under its title: the run its rows come from


def _run_label(head: list[str], i: int) -> str:
    """The run a results file's sections come from: its one run line ('onnxruntime ...; one run of `cmd` (N s;
    load average a-b)'), shortened to the command, seconds and load; a file of several runs (merged before) names
    none (its sections carry their own Run line where it wrote them)."""
    runs = [x for x in head if x.startswith("onnxruntime ")]
    if len(runs) != 1 or "one run of `" not in runs[0]:
        return f"results file {i + 1} of the merge (a merge of earlier runs; their run lines are above)"
    tail = runs[0].split("one run of ", 1)[1]
    return tail.split(". ", 1)[0]


def merge(parts: list[Path], note: str = "") -> str:
    """One results file from several: the first file's header, every run line of the others, and every model
    section once, from the first file that has it (list newer runs first to replace older rows); each section names
    its run (a 'Run:' line under its title), in the order of tm.ENCODERS and tm.FORMS; 'Not run' lists what no
    file has. note: a paragraph after the merge
    line (e.g. which netquant version the older runs measured)."""
    header: list[str] = []
    kept: dict[str, list[str]] = {}
    not_run: list[str] = []
    for i, part in enumerate(parts):
        head, sections = _sections(part.read_text())
        # each run's own line (its seconds and load average) from the second part on
        header = header + [x for x in head if x.startswith("onnxruntime ") and x not in header] if i else head
        label = _run_label(head, i)
        for title, lines in sections:
            if title == "Targets":
                continue  # per run: the merged sections' rows are in their tables
            if title == "Not run":
                not_run += [x for x in lines if x.startswith("- ") and x not in not_run]
            elif title not in kept:
                has_run = any(x.startswith(RUN_PREFIX) for x in lines[1:3])
                kept[title] = lines if has_run else [lines[0], "", f"{RUN_PREFIX}{label}", *lines[1:]]
    lines = header + [f"Merged with --merge from {len(parts)} results files: each section is taken from the first "
                      "file that has it and names its run.", "", *([note, ""] if note else [])]
    order = [f"{e.title}, {f}" for e in tm.ENCODERS.values() for f in tm.FORMS]  # models, then forms, as run
    for title in sorted(kept, key=lambda t: order.index(t) if t in order else len(order)):
        body = kept[title]
        lines += body + ([""] if body[-1] else [])
    left = [x for x in not_run if x[2:].split(": ")[0] not in kept]
    named = {x[2:].split(": ")[0] for x in left}
    left += [f"- {t}: not finished in the time the runs had (stopped)" for t in
             (f"{e.title}, {f}" for e in tm.ENCODERS.values() for f in tm.FORMS) if t not in kept and t not in named]
    if left:
        lines += ["## Not run", "", *left, ""]
    return "\n".join(lines)


def column(models: str, forms: str, n_calib: int, head: list[str],
           row: Callable[[Case, Path], list[str]]) -> str:
    """One column's markdown table (the --sizes and --quant-passes modes): `head`, then row(case, a scratch folder)
    for every section, printed row by row and returned."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory(prefix="netquant_column_") as tmp:
        for key in models.split(","):
            for form in forms.split(","):
                case = make_case(key, form, n_calib, 0)
                lines.append("| " + " | ".join([case.name, *row(case, Path(tmp))]) + " |")
                print(lines[-1], flush=True)
    return "\n".join(lines)


def quant_times(models: str, forms: str, n_calib: int, passes: int) -> str:
    """The quantization-time column only (--quant-passes N): netquant default (quantize + export with its validation)
    and ORT static MinMax alternating N times per section, each run as quantize_all times it
    (timed_quantization), every run and the ratios of medians and of fastest runs."""
    def row(case: Case, tmp: Path) -> list[str]:
        ours: list[float] = []
        peer: list[float] = []
        for i in range(passes):
            ours.append(timed_quantization("netquant default", netquant_default, case, tmp / f"netquant{i}.onnx")[0])
            peer.append(timed_quantization("ORT static", ort_static, case, tmp / f"ort{i}.onnx")[0])
        return [", ".join(f"{x:.2f}" for x in ours), ", ".join(f"{x:.2f}" for x in peer),
                f"{statistics.median(ours) / statistics.median(peer):.3f}", f"{min(ours) / min(peer):.3f}"]

    return column(models, forms, n_calib, ["section", "netquant default s", "ORT static MinMax s",
                                           "medians: netquant / ORT", "fastest: netquant / ORT"], row)


def sizes(models: str, forms: str, n_calib: int) -> str:
    """The file-size column only (--sizes): netquant default and ORT quantize_dynamic (per-channel, reduce_range)
    written for each section, no latency or cosine runs, as a markdown table (bytes, so small moves show)."""

    def row(case: Case, tmp: Path) -> list[str]:
        ours, peer = tmp / "ours.onnx", tmp / "ort.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            netquant_default(case, ours)
            ort_dynamic(True)(case, peer)
        a, b = ours.stat().st_size, peer.stat().st_size
        return [str(a), str(b), f"{a - b:+d}", f"{a / 1e6:.2f} / {b / 1e6:.2f}"]

    return column(models, forms, n_calib, ["section", "netquant default bytes", "ORT quantize_dynamic bytes",
                                           "netquant - ORT", "file MB (ours / ORT)"], row)


def timing(args: argparse.Namespace) -> Timing:
    return Timing(args.repeats, args.rounds, args.rounds_max, args.rounds_b8, args.rounds_b8_max,
                  args.quant_passes_max)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(tm.ENCODERS))
    ap.add_argument("--forms", default=",".join(tm.FORMS))
    ap.add_argument("--calib", type=int, default=16)
    ap.add_argument("--eval", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5, help="batch-1 rounds of --repeats runs each")
    ap.add_argument("--rounds-b8", type=int, default=9, help="batch-8 rounds (one run of each method a round: a "
                    "median of 3 single runs let one slow stretch decide 2-3%% differences; of 5, two files of "
                    "nearly the same graph came out 7%% apart on a 2-core AVX2 host)")
    ap.add_argument("--rounds-max", type=int, default=15, help="batch-1 rounds at most: rounds are added while "
                    "netquant's latency verdict is split or a near miss (settled_latency)")
    ap.add_argument("--rounds-b8-max", type=int, default=27, help="batch-8 rounds at most, as --rounds-max")
    ap.add_argument("--quant-passes-max", type=int, default=5, help="quantization runs of netquant and ORT static "
                    f"at most: passes are added while their times are within {QUANT_CLOSE} of each other")
    ap.add_argument("--busy", action="store_true", help="a busy host: one spinning process per core (quant_time."
                    "busy_cores), started before the first model and stopped after the last")
    ap.add_argument("--budget-min", type=float, default=90.0, help="start no new model after this many minutes")
    ap.add_argument("--quick", action="store_true", help="small sets, results not written")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--merge", type=Path, nargs="+", help="merge these results files into --out and exit (newer "
                    "first: a section is taken from the first file that has it)")
    ap.add_argument("--quant-passes", type=int, default=0, help="only the quantization-time column: netquant "
                    "default and ORT static alternating this many times per section, every run printed (minutes); "
                    "nothing written to --out")
    ap.add_argument("--targets", type=Path, help="recompute the Targets section of this results file from its "
                    "tables and its .runs.json, write it to --out and exit")
    ap.add_argument("--note", default="", help="with --merge: a paragraph for the merged file's header")
    ap.add_argument("--sizes", action="store_true", help="only the file-size column: write netquant default's and "
                    "ORT quantize_dynamic's (reduce_range) files per section and print their bytes (minutes, not "
                    "the full run's hour); nothing written to --out")
    args = ap.parse_args()
    if args.quant_passes:
        warm_imports()
        quant_times(args.models, args.forms, args.calib, args.quant_passes)  # printed row by row
        return 0
    if args.sizes:
        warm_imports()
        sizes(args.models, args.forms, args.calib)  # printed row by row
        return 0
    if args.targets:
        write_text_atomic(args.out, retarget(args.targets), "benchmark results")
        return 0
    if args.merge:
        write_text_atomic(args.out, merge(args.merge, args.note), "benchmark results")
        return 0
    if args.quick:
        args.calib, args.eval, args.repeats, args.rounds, args.rounds_b8 = 4, 1, 1, 2, 2
        args.rounds_max, args.rounds_b8_max, args.quant_passes_max = 3, 3, 2
    warm_imports()
    start = time.perf_counter()
    rows: list[tuple[Case, list[Result]]] = []
    skipped: list[str] = []
    loads: list[float] = []
    from quant_time import busy_cores

    with tempfile.TemporaryDirectory(prefix="netquant_transformers_") as tmp, busy_cores(args.busy):
        for key in args.models.split(","):
            for form in args.forms.split(","):
                label = f"{tm.ENCODERS[key].title}, {form}"
                if time.perf_counter() - start > 60 * args.budget_min:
                    skipped.append(f"{label}: not started within the {args.budget_min:.0f} min budget")
                    continue
                try:
                    case = make_case(key, form, args.calib, args.eval)
                except Exception as exc:  # noqa: BLE001 - an export failing is a result to report
                    traceback.print_exc()
                    skipped.append(f"{label}: export failed: {type(exc).__name__}: {str(exc)[:200]}")
                    continue
                loads.append(os.getloadavg()[0])
                rows.append((case, bench(case, Path(tmp), timing(args))))
                loads.append(os.getloadavg()[0])
                text = render(rows, args, time.perf_counter() - start, skipped,
                              f"{min(loads):.1f}-{max(loads):.1f}")
                if not args.quick:
                    write_text_atomic(args.out, text, "benchmark results")
                    write_text_atomic(args.out.with_suffix(".runs.json"), runs_json(rows), "benchmark run times")
        text = render(rows, args, time.perf_counter() - start, skipped,
                      f"{min(loads, default=0):.1f}-{max(loads, default=0):.1f}")
    if not args.quick:
        write_text_atomic(args.out, text, "benchmark results")
        write_text_atomic(args.out.with_suffix(".runs.json"), runs_json(rows), "benchmark run times")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
