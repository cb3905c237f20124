"""Transformer-block ops in int8 or float on onnxruntime, by measurement (export.attention rewrites them).

After the per-region INT8 / float / dynamic decision, each kind of transformer op the onnxruntime platform leaves
float by rule is tried in int8, one kind at a time, in this order: SCORES (Q·Kᵀ) static then dynamic, CONTEXT
(A·V) static then dynamic, SOFTMAX, LAYERNORM, GELU, then per-token dynamic activations of the dynamic weight
MatMuls. A try is the
current file with that kind rewritten, timed against the current file (wall clock, interleaved, batch of the
placement; a try that times faster is timed once more in the other order and the less favourable of the two counts)
and its output compared with the reference's (1 - cosine over the calibration batches kept for export checks). It is
kept when
- int8 kinds: it runs FASTER_SHARE faster and its loss is at most LOSS_GROWTH x the current loss + LOSS_FLOOR;
- per-token: its loss is at most PER_TOKEN_GAIN x the current loss (more accurate) and it is at most
  PER_TOKEN_SLOWER slower.
Kept tries become the current file; the decisions, with every try's times and losses (a loss is measured only where
the verdict needs it: a try its time already rules out records None), are returned (AttentionPlacement.as_dict,
recorded in the placement file's `measured`).
Static ranges: min / max of each tensor over the calibration batches in the FP32 graph, values at or below MASK_FLOOR
(additive mask fills: -10000, finfo.min, -inf) left out. They are computed once a try's verdict needs them: a static
try is first timed with stand-in ranges (stand_in_ranges: onnxruntime runs the same kernels whatever the scales, and
the stand-ins keep each zero point's class), then, where it times faster (or every loss is wanted), built again with
the calibrated ranges, and timed again where that changes its nodes or a zero point's class. A try its time rules
out costs no range run.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import onnx
import torch

from netquant.analysis.profile import cpu_session, wall_clock_ms
from netquant.errors import ConfigError
from netquant.export.attention import (
    AttentionRewrite,
    AttnKind,
    AttnMode,
    apply_attention,
    find_attention_ops,
    per_token_dynamic,
    tensors_to_range,
    uint8_params,
)
from netquant.graph.light import ort_session

MASK_FLOOR = -1e4
FASTER_SHARE = 0.03  # an int8 kind must run 3% faster than the current file (wall clock noise is 1-2%)
LOSS_GROWTH, LOSS_FLOOR = 1.25, 1e-6
PER_TOKEN_GAIN, PER_TOKEN_SLOWER = 0.9, 1.05
PER_TOKEN = "per_token"
CAP_SHARE = 0.5  # share of placement's cap the tries may end within (a try: two exports timed, losses where faster)
SETUP_PASSES = 3  # runs over the loss batches a first kept try needs, at most: ranges (FP32), reference, current file
TRY_RUNS = 2  # runs of each file per timing round of a try (rounds: 3, up to 5 while the verdict is unclear)
ORDER: tuple[tuple[AttnKind, AttnMode], ...] = (
    (AttnKind.SCORES, AttnMode.STATIC), (AttnKind.SCORES, AttnMode.DYNAMIC),
    (AttnKind.CONTEXT, AttnMode.STATIC), (AttnKind.CONTEXT, AttnMode.DYNAMIC),
    (AttnKind.SOFTMAX, AttnMode.STATIC), (AttnKind.LAYERNORM, AttnMode.STATIC), (AttnKind.GELU, AttnMode.STATIC))


@dataclass
class AttentionTry:
    """One measured try: `kind` ('per_token' or an AttnKind value) in `mode`, over `nodes` nodes."""

    kind: str
    mode: str
    nodes: int
    current_ms: float
    ms: float
    current_loss: float | None  # None: not measured, the try's time decided it (choose_attention's all_losses)
    loss: float | None
    kept: bool
    reason: str


@dataclass
class AttentionPlacement:
    """The measured choice: node -> mode of the kept kinds, whether per-token dynamic activations were kept, the
    static ranges they need, and every try."""

    modes: dict[str, AttnMode] = field(default_factory=dict)
    per_token: bool = False
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    needed: set[str] = field(default_factory=set)  # the tensors whose ranges the kept STATIC kinds read
    tries: list[AttentionTry] = field(default_factory=list)
    seconds: float = 0.0

    def rewrite(self) -> AttentionRewrite | None:
        """The export's rewrite for this choice (QuantizedGraph.attention_rewrite); None when nothing was kept."""
        if not self.modes and not self.per_token:
            return None
        needed = self.needed
        return AttentionRewrite(tuple(sorted((n, m) for n, m in self.modes.items())), self.per_token,
                                tuple(sorted((t, lo, hi) for t, (lo, hi) in self.ranges.items() if t in needed)))

    def as_dict(self) -> dict[str, Any]:
        """For the placement file's `measured`: the kept kinds, every try, and the rewrite (re-applied from the file by
        rewrite_from_dict; ranges exact)."""
        kept = sorted({f"{t.kind}:{t.mode}" for t in self.tries if t.kept})
        r = self.rewrite()
        rewrite = None if r is None else {"modes": [[n, m.value] for n, m in r.modes], "per_token": r.per_token,
                                          "ranges": [[t, lo, hi] for t, lo, hi in r.ranges]}
        return {"kept": kept, "tries": [{k: (float(f"{v:.6g}") if isinstance(v, float) else v)
                                         for k, v in asdict(t).items()} for t in self.tries],
                "seconds": round(self.seconds, 3), "rewrite": rewrite}


def rewrite_from_dict(data: Any, where: str) -> AttentionRewrite | None:
    """The rewrite a placement file recorded (AttentionPlacement.as_dict()['rewrite']); None when there is none.
    ConfigError naming `where` for a malformed one."""
    if not isinstance(data, dict) or data.get("rewrite") is None:
        return None
    r = data["rewrite"]
    try:
        return AttentionRewrite(tuple((str(n), AttnMode(m)) for n, m in r["modes"]), bool(r["per_token"]),
                                tuple((str(t), float(lo), float(hi)) for t, lo, hi in r["ranges"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: measured.attention.rewrite is malformed ({exc}); measure again") from exc


def calibrated_ranges(fp32: onnx.ModelProto, names: Sequence[str],
                      batches: Sequence[Mapping[str, np.ndarray]]) -> dict[str, tuple[float, float]]:
    """(min, max) of each float tensor in `names` over `batches`, run in onnxruntime on the FP32 graph (module
    docstring: mask fills left out). Tensors the graph does not have are left out."""
    import onnxruntime as ort

    have = {o.name for o in fp32.graph.output}
    values = _tensor_names(fp32)
    wanted = [n for n in names if n in values]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    sess = ort_session(fp32, so, outputs=[n for n in wanted if n not in have])
    outs = [o.name for o in sess.get_outputs()]
    keep = set(wanted)
    return _extrema((name, v) for feeds in batches for name, v in zip(outs, sess.run(None, dict(feeds)), strict=True)
                    if name in keep)


def executor_ranges(qgraph: Any, names: Sequence[str],
                    batches: Sequence[Mapping[str, np.ndarray]]) -> dict[str, tuple[float, float]]:
    """calibrated_ranges from netquant's executor: the FP32 graph (qgraph's, its own biases and weights) run on
    `batches` with one torch thread (the same values on every machine), tensors the graph does not compute left out."""
    from netquant.platforms.threads import thread_scope

    graph = qgraph.graph
    have = {o for n in graph.nodes for o in n.outputs if o} | {v.name for v in graph.inputs}
    wanted = [n for n in dict.fromkeys(names) if n in have]
    if not wanted:
        return {}
    ex = qgraph.executor(fake_quant=False)
    with thread_scope(1), torch.no_grad():
        runs = [ex.run(dict(b), outputs=wanted) for b in batches]
    return _extrema((name, v.detach().cpu().numpy()) for run in runs for name, v in run.items()
                    if isinstance(v, torch.Tensor))


def _extrema(values: Iterable[tuple[str, np.ndarray]]) -> dict[str, tuple[float, float]]:
    """(min, max) per name over its float arrays, non-finite values and mask fills (<= MASK_FLOOR) left out."""
    lo: dict[str, float] = {}
    hi: dict[str, float] = {}
    for name, v in values:
        arr = np.asarray(v)
        if not np.issubdtype(arr.dtype, np.floating):
            continue
        data = arr[np.isfinite(arr) & (arr > MASK_FLOOR)]
        if data.size:
            lo[name] = min(lo.get(name, np.inf), float(data.min()))
            hi[name] = max(hi.get(name, -np.inf), float(data.max()))
    return {k: (lo[k], hi[k]) for k in lo}


def _tensor_names(model: onnx.ModelProto) -> set[str]:
    """The tensors of `model` calibrated_ranges can range: value_info, graph inputs and node outputs."""
    return {v.name for v in model.graph.value_info} | {i.name for i in model.graph.input} | \
        {o for n in model.graph.node for o in n.output}


def _skeleton(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` without initializer data (names and types kept): what apply_attention reads, cheap to copy."""
    out = onnx.ModelProto()
    out.graph.node.extend(model.graph.node)
    out.graph.input.extend(model.graph.input)
    out.graph.output.extend(model.graph.output)
    for t in model.graph.initializer:
        out.graph.initializer.add(name=t.name, data_type=t.data_type)
    return out


def any_static_rewrite(base: onnx.ModelProto, kinds: Mapping[str, AttnKind], fp32: onnx.ModelProto) -> bool:
    """Whether any int8 try of choose_attention could rewrite a node of `base`: apply_attention on a skeleton copy with
    every tensor calibrated_ranges could range given a range (an upper bound: the real ranges are a subset, and a
    tensor without one is left alone). False lets choose_attention skip its setup (reference, current file and range
    runs in onnxruntime) with the same result: no try."""
    rangeable = _tensor_names(fp32)
    ranges = {t: (0.0, 1.0) for t in tensors_to_range(base, kinds) if t in rangeable}
    for kind, mode in ORDER:
        modes = {n: mode for n, k in kinds.items() if k is kind}
        if modes and apply_attention(_skeleton(base), modes, ranges):
            return True
    return False


NONNEGATIVE_OPS = ("Softmax", "Relu", "Sigmoid", "Abs")  # outputs >= 0: a calibrated range there starts at 0


def stand_in_ranges(model: onnx.ModelProto, names: Iterable[str]) -> dict[str, tuple[float, float]]:
    """Ranges for timing a static try before calibrating: (0, 1) for an output of NONNEGATIVE_OPS (zero point 0, as
    its calibrated range gives), (-1, 1) for any other tensor (zero point 128: nonzero, as a range reaching below 0
    gives)."""
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    return {t: (0.0, 1.0) if producer.get(t) in NONNEGATIVE_OPS else (-1.0, 1.0) for t in names}


def _zero_point_classes(ranges: Mapping[str, tuple[float, float]]) -> dict[str, bool]:
    """Per tensor: whether its zero point is 0, the class that selects onnxruntime's int8 paths (a zero point of
    0 skips the sums a nonzero one needs; any nonzero value costs the same)."""
    return {t: int(uint8_params(lo, hi)[1]) == 0 for t, (lo, hi) in ranges.items()}


def _outputs(model: onnx.ModelProto, batches: Sequence[Mapping[str, np.ndarray]], session: Any = None) -> np.ndarray:
    """All outputs of `model` on `batches`, flattened (onnxruntime CPU, one thread; `session`: built already)."""
    sess = session if session is not None else cpu_session(model, 1)
    return np.concatenate([np.asarray(o, np.float64).ravel() for b in batches for o in sess.run(None, dict(b))])


def _loss(a: np.ndarray, b: np.ndarray) -> float:
    den = float(np.linalg.norm(a) * np.linalg.norm(b))
    return 0.0 if den == 0 else max(0.0, 1.0 - float(a @ b) / den)


def choose_attention(base: onnx.ModelProto, reference: onnx.ModelProto, fp32: onnx.ModelProto,
                     feeds: Mapping[str, np.ndarray], batches: Sequence[Mapping[str, np.ndarray]],
                     deadline: float | None = None, reference_session: Any = None,
                     all_losses: bool = False, sessions: Sequence[tuple[onnx.ModelProto, Any]] = (),
                     ranges_of: Callable[[list[str]], dict[str, tuple[float, float]]] | None = None
                     ) -> AttentionPlacement:
    """Measure and decide (module docstring). base: the QDQ export as placed so far (not modified); reference: the
    model whose outputs the losses are measured against (the user's FP32 model); fp32: the graph the ranges are
    calibrated on (its tensor names are the export's); feeds: the timing batch; batches: the loss / range batches.
    A try starts only where it would end by `deadline` (perf_counter) if it took as long as the previous one
    (_can_start; the first: where the deadline has not passed). reference_session: `reference`'s onnxruntime session
    (one intra-op thread), where the caller holds one. Losses are measured where a try's verdict needs them (a static or
    dynamic kind faster in int8, a per-token try not slower), every try's with all_losses (studies). sessions:
    (model, its onnxruntime session with one intra-op thread) the caller built already (placement's of the placed
    file). ranges_of: the static ranges of the named tensors over `batches` (default: calibrated_ranges on `fp32`)."""
    start = time.perf_counter()
    result = AttentionPlacement()
    kinds = find_attention_ops(base)
    has_dynamic = any(n.op_type == "MatMulInteger" for n in base.graph.node)
    if not kinds and not has_dynamic:
        return result
    if not has_dynamic and not any_static_rewrite(base, kinds, fp32):  # no try could start: the setup would be lost
        return _finish(result, start)
    # one onnxruntime session per model, for its timings and (once needed) its loss, the current file's kept across
    # tries: id(model) -> [model, session, loss or None]
    built: dict[int, list[Any]] = {id(m): [m, sess, None] for m, sess in sessions}
    reference_out: list[np.ndarray] = []

    def session(model: onnx.ModelProto) -> Any:
        if id(model) not in built:
            built[id(model)] = [model, cpu_session(model, 1), None]
        return built[id(model)][1]

    def loss_of(model: onnx.ModelProto) -> float:
        if not reference_out:
            reference_out.append(_outputs(reference, batches, reference_session))
        entry = built[id(model)]
        if entry[2] is None:
            entry[2] = _loss(reference_out[0], _outputs(model, batches, entry[1]))
        return float(entry[2])

    cur = base
    if _past(deadline):  # no try could start: the setup (the ranges' session and runs) would be lost
        return _finish(result, start)
    names = tensors_to_range(base, kinds) if kinds else []
    calibrated: dict[str, tuple[float, float]] | None = None  # computed once a verdict needs them

    def calibrate() -> dict[str, tuple[float, float]]:
        nonlocal calibrated
        if calibrated is None:
            calibrated = (calibrated_ranges(fp32, names, batches) if ranges_of is None else ranges_of(names)) \
                if names else {}
        return calibrated

    if all_losses:
        calibrate()
    stand_in = stand_in_ranges(base, [t for t in names if t in _tensor_names(fp32)]) if names else {}

    def timed(cand: onnx.ModelProto) -> tuple[float, float]:
        """(current ms, candidate ms): a win is timed again, the other way round: the slower verdict counts."""
        pair = [session(cur), session(cand)]
        cur_ms, ms = wall_clock_ms([cur, cand], feeds, rounds=5, runs=TRY_RUNS, budget_s=1.0, sessions=pair,
                                   settled=lambda m: _clear(m[0], m[1]))
        if ms <= (1.0 - FASTER_SHARE) * cur_ms:
            again_ms, again_cur = wall_clock_ms([cand, cur], feeds, rounds=5, runs=TRY_RUNS, budget_s=1.0,
                                                sessions=pair[::-1], settled=lambda m: _clear(m[1], m[0]))
            if again_ms / again_cur > ms / cur_ms:
                cur_ms, ms = again_cur, again_ms
        return cur_ms, ms

    tries: list[tuple[str, AttnMode | None]] = [(k.value, m) for k, m in ORDER if any(v is k for v in kinds.values())] \
        + ([(PER_TOKEN, None)] if has_dynamic else [])  # per-token last: its elementwise chain rarely pays off
    skip: set[str] = set()
    last_try_s = 0.0
    for kind, mode in tries:
        if kind in skip or not _can_start(time.perf_counter(), last_try_s, deadline):
            continue
        try_start = time.perf_counter()
        cand = copy.deepcopy(cur)
        modes = {n: mode for n, k in kinds.items() if k.value == kind} if mode is not None else {}
        if mode is None:
            done = per_token_dynamic(cand)
        else:
            done = apply_attention(cand, modes, calibrated if calibrated is not None else stand_in)
        if not done:
            continue
        cur_ms, ms = timed(cand)
        timed_ok = _timed_ok(cur_ms, ms, mode)
        if mode is AttnMode.STATIC and calibrated is None and timed_ok:  # timed on stand-ins: the real file now
            exact = copy.deepcopy(cur)
            done_exact = apply_attention(exact, modes, calibrate())
            built.pop(id(cand), None)
            cand = exact
            real = _zero_point_classes(calibrate())
            same = done_exact == done and all(real.get(t, c) == c for t, c in _zero_point_classes(stand_in).items())
            done = done_exact
            if not done:
                continue
            if not same:  # other nodes or kernel paths: the calibrated file is timed itself
                cur_ms, ms = timed(cand)
                timed_ok = _timed_ok(cur_ms, ms, mode)
            else:
                session(cand)
        nodes = len(done)
        cur_loss, loss = (loss_of(cur), loss_of(cand)) if timed_ok or all_losses else (None, None)
        if not timed_ok:
            kept, reason = False, "slower" if mode is None else "not faster"
        elif mode is None:
            assert cur_loss is not None and loss is not None
            kept = loss <= PER_TOKEN_GAIN * cur_loss
            reason = "more accurate, not slower" if kept else "not more accurate"
        else:
            assert cur_loss is not None and loss is not None
            kept = loss <= LOSS_GROWTH * cur_loss + LOSS_FLOOR
            reason = "faster in int8, as accurate" if kept else "less accurate"
        result.tries.append(AttentionTry(kind, "per-token dynamic" if mode is None else mode.value, nodes,
                                         cur_ms, ms, cur_loss, loss, kept, reason))
        last_try_s = time.perf_counter() - try_start
        if not kept:
            built.pop(id(cand), None)
            continue
        built.pop(id(cur))
        skip.add(kind)  # static kept: the dynamic try of that kind is not needed
        if mode is None:
            result.per_token = True
        else:
            chosen = {n: k for n, k in kinds.items() if k.value == kind}
            result.modes.update({n: mode for n in chosen})
            if mode is AttnMode.STATIC:
                result.needed.update(tensors_to_range(base, chosen))
        cur, cur_loss = cand, loss
    result.ranges = dict(calibrated or {})
    return _finish(result, start)


def _timed_ok(cur_ms: float, ms: float, mode: AttnMode | None) -> bool:
    """A try's time allows keeping it: per-token (mode None) at most PER_TOKEN_SLOWER slower, an int8 kind
    FASTER_SHARE faster."""
    return ms <= PER_TOKEN_SLOWER * cur_ms if mode is None else ms <= (1.0 - FASTER_SHARE) * cur_ms


def _clear(cur_ms: float, ms: float) -> bool:
    """A try's timing so far leaves no doubt: the candidate is no faster at all, or faster by twice FASTER_SHARE
    (wall_clock_ms stops after its minimum rounds then)."""
    return ms >= cur_ms or ms <= (1.0 - 2 * FASTER_SHARE) * cur_ms


def _can_start(now: float, last_try_s: float, deadline: float | None) -> bool:
    """Whether a try started at `now` ends by `deadline` taking as long as the previous one (`last_try_s`; 0 before
    the first): now + last_try_s <= deadline (always where deadline is None)."""
    return deadline is None or now + last_try_s <= deadline


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.perf_counter() > deadline


def _finish(result: AttentionPlacement, start: float) -> AttentionPlacement:
    result.seconds = time.perf_counter() - start
    return result


def setup_estimate_s(batches: Sequence[Mapping[str, np.ndarray]], fp32_ms: float, build_s: float = 0.0) -> float:
    """Seconds choose_attention's setup takes before its first try, estimated: SETUP_PASSES x the rows of `batches`
    (first axis of the first input) x the batch-1 ms `fp32_ms`, plus `build_s`: the onnxruntime session its ranges
    need (the FP32 model with extra outputs), as long to build as the source's was (a 300 MB encoder's takes
    seconds, more than its runs)."""
    rows = sum(int(np.asarray(next(iter(b.values()))).shape[0]) if b and np.asarray(next(iter(b.values()))).ndim else 1
               for b in batches)
    return SETUP_PASSES * rows * fp32_ms / 1e3 + build_s


def place_attention(qgraph: Any, feeds: Mapping[str, np.ndarray] | None, source: onnx.ModelProto | None,
                    cap_s: float, max_batches: int = 2, deadline: float | None = None,
                    source_session: Any = None, fp32_ms: float | None = None,
                    build_s: float = 0.0, sessions: Sequence[tuple[onnx.ModelProto, Any]] = ()
                    ) -> AttentionPlacement | None:
    """The attention step of placement (onnxruntime): choose_attention on the QDQ export of `qgraph` as placed so far,
    against `source` (default: the cleaned FP32 graph), losses and ranges over the first `max_batches` of its
    validation batches, tries ending (at the previous try's duration) within CAP_SHARE x `cap_s` seconds (or by
    `deadline`, perf_counter, where given); source_session: `source`'s onnxruntime session (one intra-op thread)
    where the caller holds one (placement does); fp32_ms: the FP32 model's batch-1 ms, where known: with `deadline`,
    nothing is measured (None) when the setup (SETUP_PASSES runs of a model that size over the loss batches' rows:
    ranges, reference, current file; plus `build_s`, the ranges' session build: setup_estimate_s) would end past it,
    since no try could start; the choice is set as qgraph.attention_rewrite. None when there is nothing to measure
    (no batch, or no transformer op and no dynamic MatMul).
    sessions: placement's onnxruntime sessions (one thread) of the files it timed, reused where one is this export.
    The static ranges come from the executor's FP32 run of the batches (executor_ranges: no onnxruntime session of
    the FP32 model with extra outputs to build)."""
    from netquant.export.onnx_qdq import build_qdq_model, fp32_onnx

    batches = [{k: v.detach().cpu().numpy() for k, v in b.items()} for b in qgraph.validation_batches[:max_batches]]
    if feeds is None or not batches:
        return None
    if deadline is not None and fp32_ms is not None and \
            time.perf_counter() + setup_estimate_s(batches, fp32_ms, build_s) > deadline:
        return None
    qgraph.attention_rewrite = None
    base = build_qdq_model(qgraph, share=True)[0]  # not modified (choose_attention): the export may take it
    fp32 = fp32_onnx(qgraph)
    result = choose_attention(base, source if source is not None else fp32, fp32, feeds, batches,
                              deadline=deadline if deadline is not None else time.perf_counter() + CAP_SHARE * cap_s,
                              reference_session=source_session if source is not None else None, sessions=sessions,
                              ranges_of=lambda names: executor_ranges(qgraph, names, batches))
    if not result.tries:
        return None
    qgraph.attention_rewrite = result.rewrite()
    return result
