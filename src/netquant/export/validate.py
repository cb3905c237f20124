"""Validation of an exported model before it is written: checker, onnxruntime load, the CPU target's
arithmetic (no int16 pair saturation where the target has it), and agreement with the executor's
fake-quant run over several batches (cosine similarity of every output, see Agreement)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch

from netquant.core.int_kernels import Accumulation
from netquant.errors import ExportError
from netquant.export.ort_kernels import save_optimized_graph
from netquant.graph.light import ort_session as in_memory_session
from netquant.passes.quant_graph import QuantizedGraph
from netquant.platforms.threads import apply_to_session_options


def _to_numpy(x: Any) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu().numpy()
    return np.asarray(x)


def sample_feeds(qgraph: QuantizedGraph, sample: Any = None, *, seed: int = 0) -> dict[str, np.ndarray]:
    """One batch for validation: `sample`, else a batch the quantizer kept, else random data.

    Random data needs fully static input shapes (the first dim may be symbolic: batch 1).
    """
    graph = qgraph.graph
    names = [v.name for v in graph.inputs if v.name not in graph.initializers]
    if sample is None:
        sample = qgraph.sample_inputs
    if sample is not None:
        if isinstance(sample, Mapping):
            feeds = {k: _to_numpy(v) for k, v in sample.items() if k in names}
        elif isinstance(sample, (torch.Tensor, np.ndarray)):
            feeds = {names[0]: _to_numpy(sample)}
        elif isinstance(sample, Sequence):
            feeds = {n: _to_numpy(v) for n, v in zip(names, sample)}
        else:
            raise ExportError(f"validation sample must be a dict, tensor or list of tensors, got {type(sample).__name__}")
        missing = [n for n in names if n not in feeds]
        if missing:
            raise ExportError(f"validation sample lacks model inputs {missing}")
        return feeds
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in graph.inputs:
        if v.name in graph.initializers:
            continue
        shape = list(v.shape or ())
        dims = [1 if (i == 0 and not isinstance(d, int)) else d for i, d in enumerate(shape)]
        if v.shape is None or not all(isinstance(d, int) and d > 0 for d in dims):
            raise ExportError(f"cannot make a validation batch for input '{v.name}' of shape {v.shape}: "
                              "pass sample=... (one batch of real inputs) to the export")
        dtype = (torch.empty((), dtype=v.dtype).numpy().dtype if v.dtype is not None else np.float32)
        if np.issubdtype(dtype, np.floating):
            feeds[v.name] = rng.standard_normal(dims).astype(dtype)
        else:
            feeds[v.name] = rng.integers(0, 2, dims).astype(dtype)
    return feeds


def validation_feeds(qgraph: QuantizedGraph, sample: Any = None, *, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """The batches export validation runs: `sample` (one batch), else the calibration batches the quantizer
    kept (several), else one random batch."""
    kept = qgraph.validation_batches
    if sample is None and kept:
        return [sample_feeds(qgraph, b) for b in kept]
    return [sample_feeds(qgraph, sample, seed=seed)]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = a.astype(np.float64).ravel(), b.astype(np.float64).ravel()
    return _cosine64(a64, b64, float(np.linalg.norm(a64)), float(np.linalg.norm(b64)))


def _cosine64(a64: np.ndarray, b64: np.ndarray, na: float, nb: float) -> float:
    """cos(a, b) of flat float64 runs with their norms given (1.0 when both are zero)."""
    if na == 0 and nb == 0:
        return 1.0
    return float(a64 @ b64 / max(na * nb, 1e-300))


def check_model(model: onnx.ModelProto, where: str) -> None:
    try:
        onnx.checker.check_model(model)
    except Exception as exc:
        raise ExportError(f"exported model for '{where}' fails onnx.checker: {exc}") from exc


def ort_session(model: Any, where: str, optimized: bool = True, save_optimized: str | None = None) -> Any:
    """An onnxruntime CPU session of `model` (a path, serialized bytes, or a ModelProto: its large weights handed over
    in memory, graph.light.ort_session); optimized=False runs Q/DQ as defined (no fused int8 kernels); save_optimized:
    a path where onnxruntime writes the graph it runs (SessionOptions.optimized_model_filepath)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    apply_to_session_options(so)  # the thread_scope's threads, if any
    so.log_severity_level = 3
    if save_optimized is not None:
        save_optimized_graph(so, save_optimized)
    if not optimized:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        if isinstance(model, onnx.ModelProto):
            return in_memory_session(model, so)
        return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    except Exception as exc:
        raise ExportError(f"exported model for '{where}' does not load in onnxruntime: {exc}") from exc


@dataclass
class Agreement:
    """One output over all validation batches: cosines between onnxruntime, the executor's fake-quant run
    (with this machine's int8 arithmetic) and FP32."""

    ort_vs_fake_quant: float
    ort_vs_fp32: float
    fake_quant_vs_fp32: float
    max_abs_diff: float
    engine_max_abs: float = 0.0
    fp32_max_abs: float = 0.0
    batches: int = 0  # the validation batches the cosines pool (compare_with_executor)

    @property
    def zero_output(self) -> bool:
        """The engine's output is all zero while FP32's is not (a normal float32 value, >= 1.18e-38, somewhere):
        the file computes nothing, however well it agrees with a fake-quant run that is zero too."""
        return self.engine_max_abs == 0.0 and self.fp32_max_abs >= FLOAT32_TINY

    def accepted(self, min_cosine: float, max_error_ratio: float | None = 1.5) -> bool:
        """onnxruntime's output is as close to FP32 as the fake-quant run's: 1 - cos(ort, fp32) <=
        max_error_ratio * (1 - cos(fake-quant, fp32)) + QUALITY_MARGIN; max_error_ratio None: cos(ort, fake-quant)
        >= min_cosine instead.

        Deep 8-bit models amplify ordinary rounding differences (PP-OCRv4 rec's softmax: cosine ~0.95 between two
        sound runs), so agreement with the simulation refuses sound files; a file whose engine output is farther
        from FP32 than netquant's simulation (saturating kernels, a broken graph) is refused. Measured in
        benchmarks/results/validation_study.md.
        """
        if self.zero_output:
            return False
        if max_error_ratio is None:
            return self.ort_vs_fake_quant >= min_cosine
        return 1.0 - self.ort_vs_fp32 <= max_error_ratio * (1.0 - self.fake_quant_vs_fp32) + QUALITY_MARGIN


DEFAULT_MAX_ERROR_RATIO = 1.5  # the engine's (1 - cosine vs FP32) may exceed the simulation's by this factor ...
QUALITY_MARGIN = 0.002  # ... plus this much
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32: below it engines may flush to zero


def run_ort(sess: Any, feeds: Mapping[str, np.ndarray], where: str) -> list[np.ndarray]:
    """`sess`'s outputs on `feeds`; ExportError naming the file `where` when onnxruntime fails on them."""
    try:
        return sess.run(None, feeds)
    except Exception as exc:
        raise ExportError(f"exported model for '{where}' fails in onnxruntime on a validation batch: {exc}") from exc


def calibration_fp32(qgraph: QuantizedGraph, batches: Sequence[dict[str, np.ndarray]]) -> list[dict[str, Any]] | None:
    """The FP32 outputs calibration computed for `batches`, when they are the kept calibration batches (same
    arrays) and the graph is unchanged since (passes.calibration.graph_state); None otherwise."""
    from netquant.passes.calibration import graph_state

    kept, outputs = qgraph.validation_batches, qgraph.validation_fp32
    if not outputs or len(outputs) != len(batches) or len(kept) != len(batches):
        return None
    if qgraph.validation_fp32_state != graph_state(qgraph.graph):
        return None
    for feeds, batch in zip(batches, kept):
        if not isinstance(batch, Mapping) or set(batch) != set(feeds):
            return None
        if not all(np.array_equal(feeds[k], _to_numpy(batch[k])) for k in feeds):
            return None
    return outputs


def placement_fake_quant(qgraph: QuantizedGraph, feeds: Mapping[str, np.ndarray],
                         accumulation: Accumulation) -> dict[str, Any] | None:
    """The graph outputs of the placement loss pass (QuantizedGraph.fake_quant_runs) that ran this very model (same
    quant state) on these feeds with exact sums, where `accumulation` is exact; else None."""
    from netquant.export.onnx_qdq import quant_state

    if accumulation is not Accumulation.EXACT or not qgraph.fake_quant_runs:
        return None
    state = quant_state(qgraph)
    run = next((r for r in qgraph.fake_quant_runs if r.state == state), None)
    if run is None or set(run.inputs) != set(feeds):
        return None
    if not all(np.array_equal(_to_numpy(run.inputs[k]), feeds[k]) for k in feeds):
        return None
    return run.outputs


def compare_with_executor(qgraph: QuantizedGraph, sess: Any, batches: Sequence[dict[str, np.ndarray]], where: str,
                          min_cosine: float, accumulation: Accumulation = Accumulation.EXACT,
                          max_error_ratio: float | None = DEFAULT_MAX_ERROR_RATIO,
                          record: dict[str, list[np.ndarray]] | None = None,
                          engine_runs: Mapping[int, list[np.ndarray]] | None = None,
                          confirm: bool = False) -> dict[str, Agreement]:
    """Every float output over all `batches`: onnxruntime vs the executor's fake-quant run (int8 kernels summing
    as `accumulation`, i.e. this machine's onnxruntime) and vs FP32. ExportError unless every output is
    accepted (Agreement.accepted). record: filled with the engine's outputs, per output name one array per batch
    (export.fidelity compares them with FP32). engine_runs: batch index -> `sess`'s outputs of that batch where
    onnxruntime ran the same file on it already (placement's warm-up run: QuantizedGraph.engine_outputs).
    confirm: where `batches` refuse the file, the calibration batches kept after them
    (QuantizedGraph.confirmation_batches) are run too and the verdict is taken over all of them (Agreement.batches
    says how many decided): a few samples of a high-variance output refuse sound files, while an engine that
    computes differently stays refused over more."""
    fq_ex = qgraph.executor(fake_quant=True, accumulation=accumulation)
    runs: dict[str, AgreementSums] = {}
    cached = calibration_fp32(qgraph, batches)
    reused = placement_fake_quant(qgraph, batches[0], accumulation) if batches else None
    def verdict() -> tuple[dict[str, Agreement], str]:
        result = {name: sums.agreement() for name, sums in runs.items()}
        refuse_zero_outputs(result, where, "onnxruntime")
        return result, rejected(result, min_cosine, max_error_ratio)

    _collect(qgraph, sess, batches, where, fq_ex, runs, cached, reused, record, engine_runs)
    result, detail = verdict()
    more = [sample_feeds(qgraph, b) for b in qgraph.confirmation_batches] if detail and confirm else []
    if more:
        _collect(qgraph, sess, more, where, fq_ex, runs, None, None, None, None, groups=stack_groups(qgraph, more))
        result, detail = verdict()
    if detail:
        raise ExportError(f"exported model for '{where}' disagrees with netquant's fake-quant executor over "
                          f"{len(batches) + len(more)} batch(es) in onnxruntime: cosine {detail}; min_cosine "
                          f"{min_cosine}. {likely_cause(qgraph, accumulation)} No file written.")
    return result


def stack_groups(qgraph: QuantizedGraph, batches: Sequence[dict[str, np.ndarray]]) -> list[list[int]]:
    """Runs of consecutive `batches` of one layout the executor may run as one stack: up to the samples per stack
    calibration checked (CalibrationCounts.stack_samples: a stacked FP32 run gave the batches' outputs), where no
    activation is quantized at run time (a dynamic scale would span the stack); else one batch per group."""
    from netquant.passes.calib_stack import samples_in

    per_stack = qgraph.calibration.stack_samples
    if per_stack <= 1 or qgraph.calibration.stack_blocker or qgraph.dynamic_ops or qgraph.attention_rewrite is not None:
        return [[i] for i in range(len(batches))]
    groups: list[list[int]] = []
    for i, feeds in enumerate(batches):
        last = groups[-1] if groups else None
        if last is not None and _layout(feeds) == _layout(batches[last[0]]) and \
                sum(samples_in(batches[j]) for j in last) + samples_in(feeds) <= per_stack:
            last.append(i)
        else:
            groups.append([i])
    return groups


def _layout(feeds: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each input's shape past dim 0 and its dtype (batches of one layout stack along dim 0)."""
    return {k: (tuple(np.shape(v)[1:]), np.asarray(v).dtype) for k, v in feeds.items()}


def _collect(qgraph: QuantizedGraph, sess: Any, batches: Sequence[dict[str, np.ndarray]], where: str, fq_ex: Any,
             runs: dict[str, AgreementSums], cached: list[dict[str, Any]] | None,
             reused: dict[str, Any] | None, record: dict[str, list[np.ndarray]] | None,
             engine_runs: Mapping[int, list[np.ndarray]] | None, groups: list[list[int]] | None = None) -> None:
    """Run `batches` in onnxruntime (or take engine_runs), the fake-quant executor `fq_ex` (or `reused` for the
    first) and FP32 (or `cached`), adding each output's three runs to its sums in `runs` (and the engine's to
    `record`); ExportError on a shape mismatch or a non-finite engine output. groups (stack_groups; not with
    cached, reused, record or engine_runs): the batches of a group run in onnxruntime one by one, their outputs
    concatenated along dim 0, and in the executors as one stack."""
    fp_ex = qgraph.executor(fake_quant=False) if cached is None else None
    names = [m.name for m in sess.get_outputs()]
    for members in groups if groups is not None else [[i] for i in range(len(batches))]:
        i = members[0]
        if len(members) == 1:
            known = engine_runs.get(i) if engine_runs else None
            got = known if known is not None else run_ort(sess, batches[i], where)
            feeds = batches[i]
        else:
            parts = [run_ort(sess, batches[j], where) for j in members]
            got = [np.concatenate([p[k] for p in parts], axis=0) for k in range(len(names))]
            feeds = {k: np.concatenate([batches[j][k] for j in members], axis=0) for k in batches[i]}
        torch_feeds = {k: torch.from_numpy(np.ascontiguousarray(v).reshape(np.shape(v))) for k, v in feeds.items()}
        with torch.no_grad():
            fq = reused if i == 0 and reused is not None else fq_ex.run(torch_feeds)
            fp = cached[i] if cached is not None else fp_ex.run(torch_feeds)  # type: ignore[union-attr]
        for name, y in zip(names, got):
            if name not in fq:
                continue
            r = _to_numpy(fq[name])
            if r.shape != y.shape:
                raise ExportError(f"exported model for '{where}': output '{name}' has shape {y.shape} in "
                                  f"onnxruntime but {r.shape} in netquant's executor")
            if np.issubdtype(y.dtype, np.floating) and not np.isfinite(y).all():
                raise ExportError(f"exported model for '{where}' produces NaN/Inf in output '{name}'")
            if record is not None:
                record.setdefault(name, []).append(y)
            runs.setdefault(name, AgreementSums()).add(y, r, _to_numpy(fp[name]), len(members))


@dataclass
class AgreementSums:
    """One output's engine (e), fake-quant (q) and FP32 (f) runs summed batch by batch in float64 (dot products, squared
    norms, largest magnitudes): the Agreement over all batches so far, each batch widened once and never
    concatenated (PP-OCRv6 rec's 24 x 750k-element outputs: 2.1 -> 0.14 s). Non-float outputs: exact equality."""

    ee: float = 0.0
    qq: float = 0.0
    ff: float = 0.0
    eq: float = 0.0
    ef: float = 0.0
    qf: float = 0.0
    max_abs_diff: float = 0.0
    engine_max_abs: float = 0.0
    fp32_max_abs: float = 0.0
    floating: bool = True
    same: bool = True
    batches: int = 0

    def add(self, engine_y: np.ndarray, fq_y: np.ndarray, fp_y: np.ndarray, batches: int = 1) -> None:
        """The runs of `batches` validation batches (one, or a stack of several)."""
        self.batches += batches
        if not np.issubdtype(engine_y.dtype, np.floating):
            self.floating = False
            self.same = self.same and bool(np.array_equal(engine_y, fq_y))
            diff = np.abs(fq_y.astype(np.float64) - engine_y.astype(np.float64)).max(initial=0)
            self.max_abs_diff = max(self.max_abs_diff, float(diff))
            return
        e, q, f = (y.astype(np.float64).ravel() for y in (engine_y, fq_y, fp_y))
        self.ee += float(e @ e)
        self.qq += float(q @ q)
        self.ff += float(f @ f)
        self.eq += float(e @ q)
        self.ef += float(e @ f)
        self.qf += float(q @ f)
        self.max_abs_diff = max(self.max_abs_diff, float(np.abs(q - e).max(initial=0)))
        self.engine_max_abs = max(self.engine_max_abs, float(np.abs(e).max(initial=0)))
        self.fp32_max_abs = max(self.fp32_max_abs, float(np.abs(f).max(initial=0)))

    def agreement(self) -> Agreement:
        if not self.floating:
            same = float(self.same)
            return Agreement(same, same, same, self.max_abs_diff, batches=self.batches)
        ne, nq, nf = (math.sqrt(x) for x in (self.ee, self.qq, self.ff))
        return Agreement(_cosine_of(self.eq, ne, nq), _cosine_of(self.ef, ne, nf), _cosine_of(self.qf, nq, nf),
                         self.max_abs_diff, self.engine_max_abs, self.fp32_max_abs, batches=self.batches)


def _cosine_of(dot: float, na: float, nb: float) -> float:
    """dot / (na nb), 1.0 when both norms are zero (as _cosine64)."""
    if na == 0 and nb == 0:
        return 1.0
    return float(dot / max(na * nb, 1e-300))


def agreement_of(engine_y: np.ndarray, fq_y: np.ndarray, fp_y: np.ndarray) -> Agreement:
    """One output's Agreement from the flattened runs of the engine, the fake-quant executor and FP32 (non-float
    outputs: 1.0 when the engine's equals the fake-quant's exactly, else 0.0). Each run is widened to float64 once and
    its norm taken once (the cosines are `cosine`'s, bit for bit)."""
    if not np.issubdtype(engine_y.dtype, np.floating):
        diff = float(np.abs(fq_y.astype(np.float64) - engine_y.astype(np.float64)).max(initial=0))
        same = float(np.array_equal(engine_y, fq_y))
        return Agreement(same, same, same, diff)
    e, q, f = (y.astype(np.float64).ravel() for y in (engine_y, fq_y, fp_y))
    ne, nq, nf = (float(np.linalg.norm(y)) for y in (e, q, f))
    return Agreement(_cosine64(e, q, ne, nq), _cosine64(e, f, ne, nf), _cosine64(q, f, nq, nf),
                     float(np.abs(q - e).max(initial=0)), float(np.abs(e).max(initial=0)),
                     float(np.abs(f).max(initial=0)))


def refuse_zero_outputs(result: Mapping[str, Agreement], where: str, engine: str) -> None:
    """ExportError naming each float output that is all zero in the engine while FP32's is not (see
    Agreement.zero_output): such a file would pass any comparison with a fake-quant run that is zero too."""
    zero = {k: a for k, a in result.items() if a.zero_output}
    if zero:
        detail = ", ".join(f"'{k}' (max |FP32| {a.fp32_max_abs:.3g})" for k, a in zero.items())
        raise ExportError(f"exported model for '{where}': output {detail} is all zero in {engine} while the FP32 "
                          "model's is not; its quantization codes the signal as zero (tensors far smaller than "
                          "their scales). Check the calibration data's magnitude, keep the ops `layer_report` "
                          "names in float (force_fp32 / --fp32-ops). No file written.")


def rejected(result: Mapping[str, Agreement], min_cosine: float, max_error_ratio: float | None) -> str:
    """The outputs Agreement.accepted refuses, in words ('' when all are accepted)."""
    bad = {k: a for k, a in result.items() if not a.accepted(min_cosine, max_error_ratio)}
    return ", ".join(f"{k}: vs fake-quant {a.ort_vs_fake_quant:.5f}, vs FP32 {a.ort_vs_fp32:.5f} "
                     f"(fake-quant vs FP32 {a.fake_quant_vs_fp32:.5f})" for k, a in bad.items())


def likely_cause(qgraph: QuantizedGraph, accumulation: Accumulation) -> str:
    """What most often makes onnxruntime disagree, given the graph and this machine's int8 arithmetic."""
    from netquant.passes.int_emulation import kernel_sites

    risky = kernel_sites(qgraph, overflowing_only=True)
    if risky and accumulation is Accumulation.PAIRWISE_INT16:
        return (f"Likely cause: {len(risky)} op(s) (e.g. {risky[0].node.op_type} '{risky[0].node.name}') have int8 "
                "weight pairs whose products overflow the int16 pair sums of this CPU's int8 kernels (x86 without "
                "VNNI); quantize with target='any' or weight_scheme='int8-pairs' / 'int7' / 'uint8' "
                "(CLI: --target any / --weight-scheme).")
    return ("Likely causes: an op onnxruntime computes differently from its ONNX definition, or quantizers on "
            "tensors onnxruntime fuses differently; keep the ops named by `layer_report` in float (force_fp32 / "
            "--fp32-ops), or check agreement alone (max_error_ratio=None, min_cosine=...) or not at all (validate=False).")


def check_target_arithmetic(qgraph: QuantizedGraph, where: str) -> None:
    """ExportError when the platform's CPU target includes x86 without VNNI but some int8 weights can saturate
    its int16 pair sums (static: from the weights alone, whatever this machine is)."""
    from netquant.passes.int_emulation import kernel_sites
    from netquant.platforms.targets import needs_saturation_free_weights

    target = qgraph.platform.cpu_target
    if target is None or not needs_saturation_free_weights(target):
        return
    risky = kernel_sites(qgraph, overflowing_only=True)
    if risky:
        names = ", ".join(f"{s.node.op_type} '{s.node.name}' ({s.overflow_pairs} pairs)" for s in risky[:5])
        more = f" and {len(risky) - 5} more" if len(risky) > 5 else ""
        raise ExportError(
            f"exported model for '{where}' targets CPU '{target.value}', which includes x86 CPUs without VNNI, but "
            f"int8 weights of {names}{more} can overflow those CPUs' int16 pair sums (wrong results there). Use "
            "weight_scheme='int8-pairs', 'int7' or 'uint8' (CLI --weight-scheme), or target='x86-vnni' / 'arm64' "
            "if the file only runs on such CPUs. No file written.")
