"""Calibration: observe every INITIAL config's tensor through the executor, then set its params.

Weights and other constants are observed directly from their values.  Activations are observed
in FP32 (no fake quantization upstream) with the observer each config names (netquant.calib registry),
clamped at their flat lower bound (`passes.flat_ranges`); params follow the range rules of
`netquant.calib.ranges`, shared with the module API's `netquant.nn.calibrate`: activation ranges rounded
outward to settings.range_bits (default 8) significant bits, constants exact.
Batches of equal shape run stacked where that leaves every observer's input unchanged (passes.calib_stack); where
they cannot and onnxruntime runs the FP32 graph faster, min-max statistics come from onnxruntime with the executor's
scales (passes.calib_ort).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from netquant.calib.ranges import activation_params, clamp_for_observation
from netquant.core.int_kernels import pair_limited_scale
from netquant.core.qparams import QParams
from netquant.core.tensor_config import QuantState, TensorQuantConfig
from netquant.errors import CalibrationError
from netquant.graph import Executor, Graph, Node
from netquant.passes.base import Condition, PassBase, PassContext
from netquant.passes.calib_ort import (
    AUTO_MAX_WEIGHT_BYTES,
    CHECK_RTOL,
    KEEP_BYTES,
    ORT_BELOW_SAMPLES,
    ORT_FASTER,
    ORT_WORTH_S,
    CalibEngine,
    FirstBatches,
    LaterBatches,
    OrtStatistics,
    build_ort_model,
    first_batch_delta,
    ort_blocker,
    recurring_end,
    weight_bytes,
    with_extrema,
    zero_end_without_floor,
)
from netquant.passes.calib_pool import SamplePool, pool_blocker
from netquant.passes.calib_stack import (
    STACK_WORTH_BELOW,
    Extrema,
    concat,
    same_layout,
    same_outputs,
    samples_in,
    split_at,
    stack_blocker,
    stack_size,
)
from netquant.passes.distributed import (
    broadcast_from_rank0,
    check_mergeable,
    current_shard,
    merge_observers_across_ranks,
)
from netquant.passes.flat_ranges import FlatRanges, clip_bounds
from netquant.passes.matmul_ranges import range_tensor_candidates
from netquant.passes.observers import make_observer
from netquant.passes.quant_graph import CalibrationCounts, ReferenceRun, compared_tensors
from netquant.passes.quantizer import GraphIndex
from netquant.passes.value_floors import value_floors
from netquant.platforms.threads import sample_workers, thread_scope


def graph_state(graph: Graph) -> tuple[Any, ...]:
    """What FP32 outputs depend on: every node (identity, op, wiring, attributes' identity) and initializer
    (identity and torch's in-place version counter); equal states -> the executor computes the same outputs."""
    nodes = tuple((id(n), n.op_type, tuple(n.inputs), tuple(n.outputs), id(n.attrs)) for n in graph.nodes)
    inits = tuple((k, id(t), getattr(t, "_version", 0)) for k, t in graph.initializers.items())
    return id(graph), nodes, inits


def _input_bytes(batch: Mapping[str, Any]) -> int:
    """Bytes of a batch's tensors."""
    return sum(int(v.numel() * v.element_size()) for v in batch.values() if isinstance(v, torch.Tensor))


def _needs_params(cfg: TensorQuantConfig | None) -> bool:
    return cfg is not None and cfg.state is QuantState.INITIAL and cfg.dominated_by is None


VALIDATION_BATCHES = 3  # calibration batches kept for export validation ...
VALIDATION_SAMPLES = 24  # ... until they hold this many samples (the first batch always whole, a later one cut to the
# samples still needed where it can be; 16 made the LiteRT check of PP-OCRv4 rec borderline: 2 batches of 8 refused a
# file that 3 accept, 98.5% in LiteRT); the later batches up to this many samples in all are kept too
# (QuantizedGraph.confirmation_batches): with batches of one sample, 3 samples of a CTC recognizer's output can put
# onnxruntime's error at 3x the simulation's where 56 put it at 1.14x (PP-OCRv6 rec), so a refusal is confirmed on them
RANGE_KEEP_BYTES = 128 << 20  # matmul_ranges' FP32 tensors kept per later validation batch, at most
CONFIRM_KEEP_BYTES = 256 << 20  # the later batches kept for validation's second look hold at most this much input


@dataclass
class CalibrationPass(PassBase):
    """Params for every INITIAL config without a dominator: constants from their values, activations from
    observers run over ctx.calib_data (CalibrationError if activations need data and there is none)."""

    name: ClassVar[str] = "calibration"
    requires: ClassVar[frozenset[Condition]] = frozenset({Condition.CONFIGS})
    ensures: ClassVar[frozenset[Condition]] = frozenset({Condition.CALIBRATED})

    @staticmethod
    def _check_stacking(ex: Executor, first_runs: list[tuple[dict[str, Any], dict[str, Any]]], probe: Extrema,
                        probing: list[Extrema], budget: float, stats: CalibrationCounts) -> tuple[int, str | None]:
        """(samples per stack, why not stacked): the first batches (of one layout, under STACK_WORTH_BELOW samples
        each) run again as one stack must give their outputs and observed extrema up to float summation noise
        (passes.calib_stack); the stack size follows the memory budget."""
        parts = [(b, o) for b, o in first_runs if same_layout(b, first_runs[0][0])] if first_runs else []
        if len(parts) < 2:
            return 1, "the first calibration batches give no two of one shape to check stacking on"
        if len(parts) < len(first_runs):
            return 1, "the first calibration batches differ in shape"
        given = max(samples_in(b) for b, _ in parts)
        if given >= STACK_WORTH_BELOW:  # the check's extra run would cost more than stacking such batches saves
            return 1, f"the batches already hold {given} samples"
        stacked = Extrema()
        probing.append(stacked)
        whole = ex.run(concat([b for b, _ in parts]))
        stats.executor_runs += 1
        if not (stacked.same(probe) and same_outputs([o for _, o in parts], whole)):
            return 1, "a stacked run differs from the samples run one by one (an op mixes the batch dim)"
        per_sample = probe.nbytes / max(1, sum(samples_in(b) for b, _ in parts))
        return stack_size(per_sample, budget), None

    @staticmethod
    def _try_ort(graph: Graph, tensors: list[str], first: FirstBatches, first_batches: list[dict[str, Any]],
                 remaining: int, engine: CalibEngine, bits: int | None,
                 floors: dict[str, float]) -> tuple[OrtStatistics | None, float, str | None]:
        """(onnxruntime statistics, first-batch difference, why not): the first batches run in onnxruntime must give
        the executor's extrema within CHECK_RTOL and (auto) cost at most ORT_FASTER of the executor's time per batch,
        counting the executor re-runs the range ends they leave undecided would need (passes.calib_ort)."""
        if not first.run_s or not first_batches or remaining < 1:
            return None, 0.0, "no calibration batches after the first ones"
        t_ex = min(first.run_s)
        if engine is CalibEngine.AUTO and t_ex * remaining < ORT_WORTH_S:
            return None, 0.0, f"the executor needs about {t_ex * remaining:.2f} s for the rest"
        if engine is CalibEngine.AUTO and weight_bytes(graph) > AUTO_MAX_WEIGHT_BYTES:
            return None, 0.0, (f"{weight_bytes(graph) / 2 ** 20:.0f} MiB of weights (onnxruntime's session would take "
                               f"long to build; auto tries it up to {AUTO_MAX_WEIGHT_BYTES >> 20} MiB)")
        zero = zero_end_without_floor(first.ranges, floors, frozenset(v.name for v in graph.inputs))
        if engine is CalibEngine.AUTO and zero is not None:
            return None, 0.0, f"the range end of '{zero}' sits at 0 with no value floor (it recurs on a rounding boundary)"
        model = build_ort_model(graph, tensors)
        if model is None:
            return None, 0.0, "the graph is too large for one onnxruntime model with extra outputs"
        try:
            ort = OrtStatistics(model, tensors, {v.name for v in graph.inputs}, [v.name for v in graph.outputs],
                                workers=sample_workers())
            # the first batch also elementwise against the executor's kept tensors: each tensor's own noise
            got = [ort.extrema(b, first.kept if i == 0 else None) for i, b in enumerate(first_batches)]
        except Exception as exc:  # noqa: BLE001 - onnxruntime lacks an op or a type: the executor calibrates
            return None, 0.0, f"onnxruntime does not run the graph ({str(exc).splitlines()[0][:120]})"
        finally:
            first.kept.clear()
        if any(g is None for g in got):
            return None, 0.0, "onnxruntime fails, or gives a non-float or non-finite observed value, on the first batches"
        ort.first = [g for g in got if g is not None]
        delta, where = first_batch_delta(first.ranges, ort.first)
        if delta > CHECK_RTOL:
            return None, delta, f"onnxruntime's '{where}' differs from the executor's by {delta:.2g} (relative)"
        ort.noise = with_extrema(ort.noise, first.ranges, ort.first)
        assert bits is not None  # ort_blocker
        recurring = recurring_end(ort.first, delta, bits, floors, ort.noise, frozenset(ort.from_feed),
                                  first.ranges)
        if engine is CalibEngine.AUTO and recurring is not None:
            return None, delta, f"the range end of '{recurring}' recurs on a rounding boundary"
        t_ort = min(ort.run_s)
        if engine is CalibEngine.AUTO and t_ort > ORT_FASTER * t_ex:
            return None, delta, f"onnxruntime takes {1e3 * t_ort:.1f} ms per batch, the executor {1e3 * t_ex:.1f} ms"
        return ort, delta, None

    @staticmethod
    def _settle_ort_batch(ex: Executor, later: LaterBatches, later_batches: dict[int, dict[str, Any]], index: int,
                          batch: dict[str, Any], got: dict[str, tuple[float, float] | None] | None,
                          first: FirstBatches, recording: list[FirstBatches], stats: CalibrationCounts) -> None:
        """A later batch's onnxruntime extrema kept for the observers; where onnxruntime could not give them (a
        failed run, a non-float or non-finite value), the executor runs the batch with the observers attached."""
        if got is not None:
            later.add(index, got)
            later_batches[index] = batch
            return
        recording.append(first)
        try:
            ex.run(batch)
        finally:
            recording.clear()
        stats.executor_runs += 1

    @staticmethod
    def _observe_only(ex: Executor, batch: dict[str, Any], probing: list[Any], recording: list[Any]) -> None:
        """One executor run the observers see and the first batches' records (the stacking check's extrema,
        onnxruntime's comparison) do not: the samples past a cut validation batch."""
        held = (list(probing), list(recording))
        probing.clear()
        recording.clear()
        try:
            ex.run(batch)
        finally:
            probing.extend(held[0])
            recording.extend(held[1])

    @staticmethod
    def _finish_ort(ex: Executor, later: LaterBatches, batches: dict[int, dict[str, Any]], first: FirstBatches,
                    ort: OrtStatistics, delta: float, bits: int, floors: dict[str, float],
                    recording: list[FirstBatches], silent: list[bool], stats: CalibrationCounts) -> None:
        """The executor's exact extrema for the range ends onnxruntime leaves undecided (calib_ort.undecided)."""
        need = later.undecided_batches(first.ranges, delta, bits, floors, ort.noise, frozenset(ort.from_feed))
        by_batch: dict[int, set[str]] = {}
        for name, indices in need.items():
            for i in indices:
                by_batch.setdefault(i, set()).add(name)
        for i in sorted(by_batch):
            exact = FirstBatches()
            recording.append(exact)
            silent.append(True)
            try:
                ex.run(batches[i])
            finally:
                recording.clear()
                silent.clear()
            stats.executor_runs += 1
            stats.exact_reruns += 1
            for name in by_batch[i]:
                if name in exact.ranges:
                    later.replace(name, i, *exact.ranges[name])

    def run(self, ctx: PassContext) -> None:
        qgraph = ctx.quantized
        graph = qgraph.graph
        options = qgraph.platform.observer_options
        index = graph_index = GraphIndex(graph)
        flat = FlatRanges(graph, index)
        lower: dict[int, float] = {}  # id(cfg) -> don't-care lower bound of its tensor
        on_input: dict[str, list[tuple[int, TensorQuantConfig, Any]]] = {}
        on_output: dict[str, list[tuple[int, TensorQuantConfig, Any]]] = {}
        observed: list[tuple[TensorQuantConfig, Any]] = []
        tensor_of: dict[int, str] = {}  # id(cfg) -> the tensor it observes
        for oc in qgraph.op_configs.values():
            node = oc.op
            for i, cfg in enumerate(oc.inputs):
                if not _needs_params(cfg):
                    continue
                assert cfg is not None
                const = index.constant(node.inputs[i])
                obs = make_observer(cfg.observer, cfg.spec, node.inputs[i], options)
                if const is not None:
                    obs.observe(const.detach().float())
                    cfg.params = obs.compute_params()
                    if cfg.pair_limit is not None:  # int8 weights kept free of int16 pair saturation
                        cfg.params = QParams(pair_limited_scale(const.detach().float(), cfg.params.scale,
                                                                cfg.params.zero_point, cfg.spec, cfg.pair_limit),
                                             cfg.params.zero_point)
                    cfg.state = QuantState.ACTIVATED
                    continue
                on_input.setdefault(node.name, []).append((i, cfg, obs))
                observed.append((cfg, obs))
                tensor_of[id(cfg)] = node.inputs[i]
                lower[id(cfg)] = flat.lower_flat(node.inputs[i])
            for j, cfg in enumerate(oc.outputs):
                if not _needs_params(cfg):
                    continue
                assert cfg is not None
                obs = make_observer(cfg.observer, cfg.spec, node.outputs[j], options)
                on_output.setdefault(node.name, []).append((j, cfg, obs))
                observed.append((cfg, obs))
                tensor_of[id(cfg)] = node.outputs[j]
                lower[id(cfg)] = flat.lower_flat(node.outputs[j])
        qgraph.calibration = CalibrationCounts(observed_tensors=len(observed),
                                               flat_bounds=sum(1 for v in lower.values() if v > -math.inf))
        if not observed:
            return
        if ctx.calib_data is None:
            names = ", ".join(c.name for c, _ in observed[:5])
            raise CalibrationError(f"{len(observed)} activation tensors need calibration data ({names}, ...); "
                                   f"pass calib_data")

        use_flat = ctx.settings.flat_ranges
        bits = ctx.settings.range_bits
        budget = ctx.settings.calib_stack_mb
        engine = CalibEngine.parse(ctx.settings.calib_engine)
        top_level = {v.name for v in graph.inputs} | {o for n in graph.nodes for o in n.outputs if o}
        tensors = list(dict.fromkeys(tensor_of[id(c)] for c, _ in observed))
        ort_why = "calib_engine is 'executor'" if engine is CalibEngine.EXECUTOR else ort_blocker(
            [o for _, o in observed], tensors, top_level, ctx.settings.device, ctx.settings.range_bits,
            ctx.calib_data.num_batches is not None, ctx.settings.distributed)
        graph_inputs = [(v.name, v.shape) for v in graph.inputs if v.name not in graph.initializers]
        blocker = ("calib_stack_mb is off" if not budget else
                   "range_bits=None asks for exact ranges, and a stacked MatMul may sum in another order (last bit)"
                   if ctx.settings.range_bits is None else stack_blocker(graph_inputs, (o for _, o in observed))
                   # asked for by name: onnxruntime runs the batches as given (stacked executor runs leave it unused)
                   or ("calib_engine is 'onnxruntime': it runs the batches as given"
                       if engine is CalibEngine.ONNXRUNTIME and ort_why is None else None))
        probe = Extrema()  # extrema of the first batches run one by one, for the stacking check
        feeding = True  # False: the stacking check's extra run, which the observers must not see
        probing: list[Extrema] = [probe] if blocker is None else []
        floors = value_floors(graph, lambda n: clip_bounds(graph_index, n)[0], graph_index.constant,
                              lambda n: clip_bounds(graph_index, n)[1]) if ort_why is None else {}
        # the executor's extrema and run times over the first batches (onnxruntime's check), its first run's tensors
        first = FirstBatches(keep_bytes=KEEP_BYTES if ort_why is None else 0)
        recording: list[FirstBatches] = [first] if ort_why is None else []
        silent: list[bool] = []  # non-empty: a run that only records (exact values of undecided range ends)
        ort: OrtStatistics | None = None
        later = LaterBatches()
        later_batches: dict[int, dict[str, Any]] = {}
        delta = 0.0
        # stacking ruled out up front (a static batch dim, batch-dependent observers): onnxruntime is tried after the
        # first batch, and runs the other first batches too (their FP32 outputs kept for export validation)
        early = ort_why is None and blocker is not None

        def feed(cfg: TensorQuantConfig, obs: Any, x: torch.Tensor) -> None:
            bound = lower.get(id(cfg), -math.inf)
            obs.observe(clamp_for_observation(x, bound) if use_flat and bound > -math.inf else x)

        # matmul_ranges' tensors, kept from the later validation batches' executor runs with one thread (its own
        # thread count) where they fit in RANGE_KEEP_BYTES (sized on the first batch)
        range_wanted = set(range_tensor_candidates(graph)) if torch.get_num_threads() == 1 else set()
        range_bytes: dict[str, int] = {}

        def observe(key: tuple[str, str, int], cfg: TensorQuantConfig, obs: Any, x: Any) -> None:
            if not isinstance(x, torch.Tensor):
                return
            if range_wanted and first_batches == 1 and tensor_of[id(cfg)] in range_wanted:
                range_bytes[tensor_of[id(cfg)]] = x.numel() * x.element_size()
            if probing:
                probing[-1].add(key, x)
            if recording and feeding:  # (not the stacking check's extra run)
                recording[-1].add(tensor_of[id(cfg)], x)
            if not feeding or silent:
                return
            feed(cfg, obs, x)

        def pre(node: Node, inputs: list[Any]) -> None:
            for i, cfg, obs in on_input.get(node.name, ()):
                observe((node.name, "in", i), cfg, obs, inputs[i])

        def post(node: Node, outputs: list[Any]) -> None:
            for j, cfg, obs in on_output.get(node.name, ()):
                if j < len(outputs):
                    observe((node.name, "out", j), cfg, obs, outputs[j])

        output_names = list(dict.fromkeys(v.name for v in graph.outputs))
        ex = Executor(graph, device=ctx.settings.device)
        ex.add_pre_hook(pre)
        ex.add_post_hook(post)
        data = ctx.calib_data
        keep_outputs = ex.device.type == "cpu" and not qgraph.validation_batches  # validation runs on the CPU
        workers = sample_workers()  # sample threads the later batches may take (CPU only: pool_blocker, keep_outputs)
        first_runs: list[tuple[dict[str, Any], dict[str, Any]]] = []  # (batch, FP32 outputs) run one by one
        limit = 1  # samples per stacked run (1: every batch as given)
        decided = False
        pending: list[dict[str, Any]] = []
        stats = qgraph.calibration

        def flush() -> None:
            if pending:
                ex.run(concat(pending))
                stats.executor_runs += 1
                pending.clear()

        shard = current_shard() if ctx.settings.distributed else None  # passes.distributed
        if shard is not None:
            check_mergeable([o for _, o in observed])
            keep_outputs = keep_outputs and shard.rank == 0
        first_batches = first_samples = confirm_samples = confirm_bytes = 0
        keep_confirmation = not qgraph.confirmation_batches  # (a second calibration run keeps none again)
        pool: SamplePool | None = None  # the later batches on sample threads (passes.calib_pool)
        pool_why: str | None = None

        def pool_map(hooked: dict[str, list[tuple[int, TensorQuantConfig, Any]]]) -> dict[str, list[tuple[int, str]]]:
            return {n: [(i, tensor_of[id(c)]) for i, c, _ in v] for n, v in hooked.items()}

        with torch.no_grad(), contextlib.ExitStack() as closing:
            closing.callback(lambda: pool.close() if pool is not None else None)  # an error mid-loop: threads back
            closing.callback(lambda: ort.close() if ort is not None else None)
            ort_jobs: list[tuple[int, dict[str, Any], Any]] = []  # later batches on onnxruntime's batch threads
            for index, batch in enumerate(ctx.track(data, "calibrating", total=data.num_batches)):
                if qgraph.sample_inputs is None:
                    qgraph.sample_inputs = batch  # one real batch, kept for export validation and reports
                    given = samples_in(batch)
                    if engine is CalibEngine.AUTO and ort_why is None and given >= ORT_BELOW_SAMPLES:
                        ort_why = (f"the batches hold {given} samples (the executor's kernels dominate there: "
                                   f"onnxruntime would not save its session's and check runs' time)")
                        recording.clear()  # (nothing to compare)
                if first_batches < VALIDATION_BATCHES and first_samples < VALIDATION_SAMPLES:
                    # a later batch that would take the kept ones past VALIDATION_SAMPLES is kept cut to the samples
                    # still needed, where samples run alike in any grouping (blocker None); the rest is observed
                    # right after (validation then runs 24 samples, not 32, of batches of 16)
                    parts = split_at(batch, VALIDATION_SAMPLES - first_samples) \
                        if first_batches and blocker is None else None
                    batch, tail = parts if parts is not None else (batch, None)
                    first_batches += 1
                    first_samples += samples_in(batch)
                    qgraph.validation_batches.append(batch)
                    if shard is not None and shard.rank != 0:
                        continue  # rank 0 observes the first batches, as one process would
                    if ort is not None:  # the early path: onnxruntime chosen after the first batch
                        got, outs = ort.run(batch, keep_outputs)
                        stats.ort_runs += 1
                        if got is not None:
                            later.add(index, got)
                            later_batches[index] = batch
                            ort.first.append(got)
                            if keep_outputs:
                                qgraph.validation_fp32.append(outs)
                            continue
                        recording.append(first)  # a value onnxruntime cannot give: the executor runs this batch
                    kept = sorted(range_bytes) if first_batches > 1 and range_bytes and \
                        sum(range_bytes.values()) * samples_in(batch) <= RANGE_KEEP_BYTES * samples_in(
                            qgraph.validation_batches[0]) else []  # (range_bytes: filled on one thread only)
                    # a small first batch where later ones run one per sample thread: on one thread too (its time
                    # compares with theirs, and its FP32 values are then the placement budget's reference as is)
                    one_thread = first_batches == 1 and keep_outputs and workers > 1 and \
                        samples_in(batch) < STACK_WORTH_BELOW
                    reference = first_batches == 1 and keep_outputs and (torch.get_num_threads() == 1 or one_thread)
                    if reference:
                        kept = [t for t in compared_tensors(graph) if t not in output_names]
                    with thread_scope(1) if one_thread else contextlib.nullcontext():
                        start = time.perf_counter()
                        outputs = ex.run(batch, outputs=[*output_names, *kept]) if kept else ex.run(batch)
                        run_s = time.perf_counter() - start
                    if tail is None:  # (a cut batch's time would understate the batches')
                        first.run_s.append(run_s)
                    else:
                        self._observe_only(ex, tail, probing, recording)
                        stats.executor_runs += 1
                    if reference:
                        qgraph.reference_run = ReferenceRun(graph_state(graph), dict(batch), dict(outputs))
                        outputs = {n: outputs[n] for n in output_names}
                    elif kept:
                        qgraph.range_tensors[first_batches - 1] = {n: outputs[n] for n in kept}
                        outputs = {n: outputs[n] for n in output_names}
                    stats.executor_runs += 1
                    if keep_outputs:  # export validation's FP32 reference, not computed again there
                        qgraph.validation_fp32.append(outputs)
                    if probing:
                        first_runs.append((batch, outputs))
                    if early and ort is None and ort_why is None and data.num_batches > 1:
                        ort, delta, ort_why = self._try_ort(graph, tensors, first, [batch], data.num_batches - 1,
                                                            engine, bits, floors)
                    if early:
                        recording.clear()
                    continue
                if keep_confirmation and first_samples + confirm_samples < VALIDATION_SAMPLES:  # validation's 2nd look
                    confirm_bytes += _input_bytes(batch)
                    if confirm_bytes <= CONFIRM_KEEP_BYTES:
                        qgraph.confirmation_batches.append(batch)
                        confirm_samples += samples_in(batch)
                    else:  # (large inputs: the second look keeps what fits)
                        keep_confirmation = False
                if not decided:
                    decided = True
                    if blocker is None and (shard is None or shard.rank == 0):
                        feeding = False
                        limit, blocker = self._check_stacking(ex, first_runs, probe, probing, budget, stats)
                        feeding = True
                    if shard is not None:  # the other ranks stack as rank 0 found it may
                        limit, blocker = broadcast_from_rank0((limit, blocker))
                    probing.clear()
                    first_runs.clear()
                    if limit <= 1 and ort_why is None and ort is None:
                        ort, delta, ort_why = self._try_ort(graph, tensors, first, qgraph.validation_batches,
                                                            data.num_batches - first_batches, engine, bits, floors)
                    elif ort is not None and engine is CalibEngine.AUTO and bits is not None:
                        recurring = recurring_end(ort.first, delta, bits, floors, ort.noise,  # (early path: 2+)
                                                  frozenset(ort.from_feed), first.ranges)
                        if recurring is not None:  # back to the executor; the batches run so far are settled below
                            ort, ort_why = None, f"the range end of '{recurring}' recurs on a rounding boundary"
                    recording.clear()
                    first.kept.clear()
                if shard is not None and not shard.owns(index, first_batches):
                    continue
                if ort is not None:
                    stats.ort_runs += 1
                    if ort.workers > 1:  # on the session's batch threads; settled in order after the loop
                        ort_jobs.append((index, batch, ort.submit(batch)))
                        continue
                    self._settle_ort_batch(ex, later, later_batches, index, batch, ort.extrema(batch), first,
                                           recording, stats)
                    continue
                if limit <= 1:
                    if pool is None and pool_why is None:
                        remaining = (data.num_batches or 0) - index
                        pool_why = pool_blocker([o for _, o in observed], workers, ctx.settings.device,
                                                shard is not None, first.run_s, remaining)
                        if pool_why is None:
                            pool = SamplePool(graph, pool_map(on_input), pool_map(on_output), workers)
                    if pool is not None:
                        pool.submit(index, batch)
                        continue
                    ex.run(batch)
                    stats.executor_runs += 1
                    continue
                if pending and (not same_layout(pending[0], batch)
                                or sum(map(samples_in, pending)) + samples_in(batch) > limit):
                    flush()
                pending.append(batch)
                if sum(map(samples_in, pending)) >= limit:
                    flush()
            flush()
            for i, batch, job in ort_jobs:  # (in batch order)
                self._settle_ort_batch(ex, later, later_batches, i, batch, job.result(), first, recording, stats)
            if ort is not None:
                ort.close()
                if ort_jobs:
                    stats.sample_workers = ort.workers
            if pool is not None:  # exact extrema (the executor's own runs): nothing undecided
                for i, batch, got in pool.results():
                    stats.executor_runs += 1
                    if got is None:  # a non-finite value: the observers see the batch itself
                        ex.run(batch)
                        stats.executor_runs += 1
                    else:
                        later.add(i, got)
                stats.sample_workers = pool.workers
            if later.per_tensor:
                if ort is not None:
                    assert bits is not None  # ort_blocker: range_bits=None stays on the executor
                    self._finish_ort(ex, later, later_batches, first, ort, delta, bits, floors, recording, silent,
                                     stats)
                for cfg, obs in observed:
                    pairs = later.pairs(tensor_of[id(cfg)])
                    if pairs is not None:
                        feed(cfg, obs, pairs)
        if shard is not None:
            merge_observers_across_ranks([o for _, o in observed])
        if not decided and blocker is None:
            blocker = "every calibration batch was one of the first, run one by one for export validation"
        stats.stack_samples = limit
        stats.stack_blocker = blocker or ""
        stats.engine = "onnxruntime" if ort is not None else "executor"
        stats.engine_note = ort_why or ""
        if keep_outputs:
            qgraph.validation_fp32_state = graph_state(graph)
        for cfg, obs in observed:
            cfg.params = activation_params(obs, bits)
            cfg.state = QuantState.ACTIVATED
