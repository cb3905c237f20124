"""FP32 calibration statistics from onnxruntime, identical to the executor's.

Where onnxruntime runs the FP32 graph faster than netquant's torch executor (batch-1 CNNs such as the onnx light
models, whose static batch dim rules out stacking), calibration runs the cleaned-up graph in onnxruntime with the
tensors the observers need exposed as extra graph outputs, and feeds the same observers.

Which observers: per-tensor observers that read only a batch's extrema (`Observer.reads_values` False and
`order_invariant`: min-max, onnxruntime's platform default). Per batch, onnxruntime's (min, max) of each tensor is
kept (two floats; ReduceMin / ReduceMax / ReduceSum nodes in onnxruntime instead, to copy out 3 scalars per tensor,
took longer: 1.14-1.2x the run time on squeezenet and inception_v1); the observer is fed those pairs at the end,
which leaves a min-max observer in the state the whole tensors would (its state is the running extremes).

Identical statistics. onnxruntime and the executor compute the same float32 values up to summation order (another
conv / matmul kernel), so a range end may differ in its last bits. Calibration's range rounding (calib.ranges,
range_bits, default 8) absorbs that except where an end lies within that noise of a rounding boundary. So:

1. the first calibration batches (run by the executor anyway: they are export validation's FP32 reference; where
   stacking is ruled out up front, a static batch dim, only the first one, and onnxruntime runs the other validation
   batches with the graph outputs fetched as that reference) also run in onnxruntime; delta = the largest
   |onnxruntime - executor| of any observed tensor's extremum over them, relative to the tensor's magnitude.
   delta > CHECK_RTOL (an op onnxruntime computes another way): executor only. On the first batch each observed
   tensor is also compared element by element (up to KEEP_BYTES of the executor's tensors kept): its own
   difference by magnitude (passes.calib_noise), so a tensor spanning [-1.3, 74] gets the margin of its values
   near -1.3 at its lower end, not one scaled by 74;
2. each later range end then lies within margin = NOISE_SAFETY * max(noise at twice the end's magnitude,
   NOISE_FLOOR * magnitude) of onnxruntime's (where a tensor was not compared: NOISE_SAFETY * max(delta,
   NOISE_FLOOR) * the tensor's magnitude) (`undecided`); graph inputs' extrema are read from the batch itself
   (exact); a lower end cannot go below the tensor's value floor (passes.value_floors: ReLU's 0, hard-swish's
   minimum -0.375 as both engines compute it, carried through w * h + b). Where every value in that interval
   rounds to the same end, onnxruntime's value gives the executor's scale; where it does not, the executor runs the
   few batches whose onnxruntime extremum could be the end, and their exact values are fed instead.

The scales and zero points are then those of executor-only calibration whenever the engines differ on a later batch
by at most NOISE_SAFETY times the difference seen on the first batch (tests: bit-identical params on CNNs, the light
models, PP-OCRv4 rec and models with undecided ends). range_bits=None (exact ranges) always runs the executor.

Choice (CalibEngine.AUTO): onnxruntime is tried only for graphs of at most AUTO_MAX_WEIGHT_BYTES of initializers (its
session's build grows with the weights and is paid before its speed is known: vgg19's 548 MB took longer to
quantize with it, 1.18x ORT MinMax's time vs 0.96x with the executor), where stacking is ruled out (a static batch
dim, batch-dependent observers) on batches of fewer than ORT_BELOW_SAMPLES samples (on batches of 16, the executor's
kernels dominate its time and onnxruntime took 0.75-0.95x of it per batch on PP-OCRv4 rec, the encoder, ViT and
DistilBERT: the session's build and the check runs cost more than the later batches save), the data can be read
twice (a materialised set) and the executor's time for the remaining batches (its fastest first-batch run x their
number) is at least ORT_WORTH_S; it is used when its fastest first-batch run takes at most ORT_FASTER of the
executor's (measured, same threads). An end undecided on every first batch recurs on a rounding boundary: every
batch would need an executor re-run, so auto keeps (or goes back to) the executor (`recurring_end`; a lower end
the executor's first batches reached at the tensor's floor is exact and does not count). CalibEngine.ONNXRUNTIME (by
name) runs onnxruntime wherever it can give the statistics, on the batches as given (the executor's stacking is not
tried: stacked executor runs would leave it unused); EXECUTOR never tries it.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from netquant.calib.ranges import round_range_outward
from netquant.core.spec import Granularity
from netquant.errors import ConfigError
from netquant.passes.calib_noise import KEEP_ELEMENTS, Kept, NoiseProfile

CHECK_RTOL = 1e-4  # onnxruntime's first-batch extrema must match the executor's this closely (relative)
NOISE_SAFETY = 4.0  # later batches may differ by this many times the largest first-batch difference
NOISE_FLOOR = 2.0 ** -22  # relative: below a float32 ulp-level difference nothing is trusted to be smaller
ORT_WORTH_S = 0.25  # auto: onnxruntime is tried when the executor would need at least this long for the rest
ORT_FASTER = 0.95  # auto: ... and used when its per-batch time is at most this share of the executor's (its session is
# built by then: any gain on the remaining batches counts, less a margin for timing noise)
ORT_BELOW_SAMPLES = 8  # auto: onnxruntime is tried on batches of fewer samples (module docstring)
AUTO_MAX_WEIGHT_BYTES = 64 << 20  # auto: larger weights stay on the executor (the session's build grows with them)
KEEP_BYTES = 256 << 20  # the executor's observed tensors of the first batch kept for the elementwise comparison ...
MAX_MODEL_BYTES = 1 << 30  # larger graphs (protobuf's 2 GiB limit with extra outputs) stay on the executor
FLOAT32_TINY = float(torch.finfo(torch.float32).tiny)


class CalibEngine(enum.StrEnum):
    """Which engine computes FP32 calibration statistics (module docstring)."""

    AUTO = "auto"
    EXECUTOR = "executor"
    ONNXRUNTIME = "onnxruntime"

    @classmethod
    def parse(cls, value: CalibEngine | str) -> CalibEngine:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"calib_engine must be one of {', '.join(e.value for e in cls)}, "
                              f"got {value!r}") from None


def ort_blocker(observers: Sequence[Any], tensors: Sequence[str], top_level: set[str], device: str,
                range_bits: int | None, materialised: bool, distributed: bool) -> str | None:
    """Why onnxruntime cannot give these observers' statistics (None: it may, subject to the first-batch check)."""
    if str(device) != "cpu":
        return f"device {device}"
    if range_bits is None:
        return "range_bits=None asks for exact ranges, and onnxruntime may sum in another order (last bit)"
    if distributed:
        return "distributed calibration"
    if not materialised:
        return "streamed calibration data (undecided range ends need a second look at a batch)"
    for obs in observers:
        if obs.reads_values or not obs.order_invariant:
            return f"observer '{obs.name}' of '{obs.tensor_name}' reads more than the extrema"
        if obs.spec.granularity is not Granularity.PER_TENSOR:
            return f"observer of '{obs.tensor_name}' is per-channel on an activation"
    missing = next((t for t in tensors if t not in top_level), None)
    if missing is not None:
        return f"observed tensor '{missing}' is inside a subgraph"
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        return "onnxruntime is not installed"
    return None


def rounded(v: float, bits: int) -> float:
    """v as calib.ranges rounds a range end (float32, outward to `bits` significant bits)."""
    t = torch.tensor([v], dtype=torch.float32)
    return float(round_range_outward(t, t, bits)[1][0])


def undecided(exact: float | None, ort: Sequence[float], margin: float, bits: int,
              ceiling: float = math.inf) -> list[int]:
    """Upper range end (max) over an exactly known part `exact` (None: none) and batches whose executor maxima lie
    within `margin` of onnxruntime's `ort` and at most `ceiling`: [] when every possible end rounds alike (onnxruntime's values give the
    executor's scale), else the indices of `ort` whose executor value is needed (those that could be the max).
    'Alike' compares max(rounded end, 0): choose_qparams covers [min(lo, 0), max(hi, 0)], so a ReLU's lower end 0
    (or any end on the far side of zero) is decided whatever its noise. Lower ends: call with everything negated
    (the rounding is symmetric about zero)."""
    if not ort:
        return []
    top = max(ort)
    low = top - margin if exact is None else max(exact, top - margin)
    high = min(top + margin, max(ceiling, top))
    high = high if exact is None else max(exact, high)
    if max(rounded(low, bits), 0.0) == max(rounded(high, bits), 0.0):  # choose_qparams reads max(hi, 0)
        return []
    return [i for i, v in enumerate(ort) if v + margin >= low]


def _extrema(x: torch.Tensor) -> tuple[float, float] | None:
    """(min, max) of a float tensor; None when empty."""
    if x.numel() == 0:
        return None
    lo, hi = torch.aminmax(x.reshape(-1))
    return float(lo), float(hi)


@dataclass
class FirstBatches:
    """The executor's (min, max) per observed tensor over the first batches, its fastest run, and (keep_bytes > 0)
    the observed tensors of its first run (strided, `Kept`), up to keep_bytes (onnxruntime's elementwise comparison,
    passes.calib_noise)."""

    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    run_s: list[float] = field(default_factory=list)
    kept: dict[str, Kept] = field(default_factory=dict)
    keep_bytes: int = 0

    def add(self, name: str, x: torch.Tensor) -> None:
        x = x.detach().float()
        got = _extrema(x)
        if got is None:
            return
        if not self.run_s and name not in self.kept and min(x.numel(), KEEP_ELEMENTS) * 4 <= self.keep_bytes:
            self.kept[name] = Kept.of(x)
            self.keep_bytes -= self.kept[name].values.numel() * 4
        old = self.ranges.get(name)
        self.ranges[name] = got if old is None else (min(old[0], got[0]), max(old[1], got[1]))


class OrtStatistics:
    """The graph in onnxruntime with `tensors` exposed as outputs; per batch, each tensor's (min, max)."""

    def __init__(self, model_bytes: bytes, tensors: Sequence[str], graph_inputs: set[str],
                 graph_outputs: Sequence[str] = (), workers: int = 1) -> None:
        """workers > 1: the later batches run on that many threads at once (`submit`), the session on one intra-op
        thread each (onnxruntime's Run is thread-safe); else on the thread_scope's threads."""
        import onnxruntime as ort

        from netquant.platforms.threads import apply_to_session_options

        self.from_feed = [t for t in tensors if t in graph_inputs]
        self.fetched = [t for t in tensors if t not in graph_inputs]
        self.graph_outputs = [o for o in graph_outputs if o not in graph_inputs]
        so = ort.SessionOptions()
        apply_to_session_options(so)
        if workers > 1:
            so.intra_op_num_threads = 1
            so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self.workers = workers
        self._pool: ThreadPoolExecutor | None = None
        self.session = ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
        self.inputs = {i.name for i in self.session.get_inputs()}
        self.run_s: list[float] = []
        self.first: list[dict[str, tuple[float, float] | None]] = []  # extrema of the first batches run here
        self.noise: dict[str, NoiseProfile] = {}  # tensor -> its difference from the executor by magnitude

    def submit(self, batch: Mapping[str, torch.Tensor]) -> Future[dict[str, tuple[float, float] | None] | None]:
        """`extrema` of a later batch on one of `workers` threads (started on first use; `close` ends them)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="netquant-calib-ort")
        return self._pool.submit(self.extrema, batch)

    def close(self) -> None:
        """Shut the batch threads down (pending batches dropped); idempotent."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def extrema(self, batch: Mapping[str, torch.Tensor], executor: Mapping[str, Kept] | None = None
                ) -> dict[str, tuple[float, float] | None] | None:
        """{tensor: (min, max) or None when empty} for one batch; None when a value is not finite or not float (the
        executor then runs the batch, and its observers say what is wrong). executor: its tensors of this batch
        (FirstBatches.kept): each one's difference is recorded in self.noise (passes.calib_noise)."""
        return self.run(batch, False, executor)[0]

    def run(self, batch: Mapping[str, torch.Tensor], with_outputs: bool,
            executor: Mapping[str, Kept] | None = None
            ) -> tuple[dict[str, tuple[float, float] | None] | None, dict[str, torch.Tensor]]:
        """(extrema as `extrema` gives them, the graph outputs as tensors when with_outputs); (None, {}) when
        onnxruntime fails on the batch."""
        feeds = {k: v.detach().cpu().numpy() for k, v in batch.items() if k in self.inputs}
        extra = [o for o in self.graph_outputs if o not in self.fetched] if with_outputs else []
        start = time.perf_counter()
        try:
            outs = self.session.run(self.fetched + extra, feeds) if self.fetched or extra else []
        except Exception:  # noqa: BLE001 - a batch onnxruntime cannot run (a shape it refuses): the executor runs it
            return None, {}
        self.run_s.append(time.perf_counter() - start)
        named = dict(zip(self.fetched + extra, outs))
        graph_out = {o: torch.from_numpy(np.asarray(named[o])) for o in self.graph_outputs if o in named} \
            if with_outputs else {}
        return self._extrema_of(batch, outs[:len(self.fetched)], executor or {}), graph_out

    def _extrema_of(self, batch: Mapping[str, torch.Tensor], outs: Sequence[Any], executor: Mapping[str, Kept]
                    ) -> dict[str, tuple[float, float] | None] | None:
        got: dict[str, tuple[float, float] | None] = {}
        arrays = [*zip(self.fetched, outs), *((t, batch[t]) for t in self.from_feed)]
        pairs: list[tuple[str, torch.Tensor]] = []  # each tensor's [min, max], read back in one conversion
        for name, arr in arrays:
            t = arr if isinstance(arr, torch.Tensor) else torch.from_numpy(np.asarray(arr))
            if not t.is_floating_point():
                return None
            if t.numel() == 0:
                got[name] = None
            else:
                pairs.append((name, torch.stack(torch.aminmax(t.detach().reshape(-1).float()))))
            if name in executor and name not in self.from_feed:
                profile = NoiseProfile.measure(t, executor[name])
                if profile is not None:
                    self.noise[name] = profile
        values = torch.stack([p for _, p in pairs]).tolist() if pairs else []
        for (name, _), (lo, hi) in zip(pairs, values, strict=True):
            if not (math.isfinite(lo) and math.isfinite(hi)):
                return None
            got[name] = (lo, hi)
        return {name: got[name] for name, _ in arrays}  # (in the tensors' order)


def weight_bytes(graph: Any) -> int:
    """Bytes of the graph's initializers."""
    return sum(t.numel() * t.element_size() for t in graph.initializers.values())


def build_ort_model(graph: Any, tensors: Sequence[str]) -> bytes | None:
    """The graph as ONNX bytes with `tensors` among its outputs (IR >= 4: initializers are not inputs); None when it
    is too large to serialise in one piece."""
    import onnx
    from onnx import helper

    from netquant.graph import to_onnx

    if weight_bytes(graph) > MAX_MODEL_BYTES:
        return None
    model = to_onnx(graph, check=False)
    if model.ir_version < 4:
        inits = {t.name for t in model.graph.initializer}
        inputs = [v for v in model.graph.input if v.name not in inits]
        del model.graph.input[:]
        model.graph.input.extend(inputs)
        model.ir_version = 4
    known = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    for name in dict.fromkeys(tensors):
        if name not in known:
            model.graph.output.append(helper.make_empty_tensor_value_info(name))
    assert isinstance(model, onnx.ModelProto)
    return model.SerializeToString()


def zero_end_without_floor(ranges: Mapping[str, tuple[float, float]], floors: Mapping[str, float],
                           exact: frozenset[str] = frozenset()) -> str | None:
    """A tensor whose range end the executor's first batches put at exactly 0 with no value floor of 0 there (a
    Concat of a ReLU branch and an unbounded one): any margin around onnxruntime's 0 straddles 0, so that end is
    undecided on every batch reaching it (`undecided`) and each would need an executor re-run: recurring_end's case,
    seen before onnxruntime runs. exact: tensors read from the batch itself. None when there is none."""
    for name, (lo, hi) in ranges.items():
        if name in exact:
            continue
        if (lo == 0.0 and floors.get(name, -math.inf) < 0.0) or hi == 0.0:
            return name
    return None


def recurring_end(ort_first: Sequence[Mapping[str, tuple[float, float] | None]], delta: float, bits: int,
                  floors: Mapping[str, float], noise: Mapping[str, NoiseProfile] | None = None,
                  exact: frozenset[str] = frozenset(),
                  executor: Mapping[str, tuple[float, float]] | None = None) -> str | None:
    """A tensor whose range end onnxruntime leaves undecided on every one of these (at least two) batches: its end
    recurs on a rounding boundary, so every later batch would need an executor re-run; None when there is none.
    A lower end the executor's first batches (`executor`: their ranges) reached at the tensor's floor (hard-swish's
    minimum -0.375, behind w * h + b) is known exactly: no later batch goes below it."""
    if len(ort_first) < 2:
        return None
    trial = LaterBatches()
    for i, g in enumerate(ort_first):
        trial.add(i, g)
    pinned = {k: (f, f) for k, f in floors.items() if executor and k in executor and executor[k][0] == f}
    return next((k for k, v in trial.undecided_batches(pinned, delta, bits, floors, noise, exact).items()
                 if len(v) == len(ort_first)), None)


def first_batch_delta(executor: Mapping[str, tuple[float, float]],
                      ort: Sequence[Mapping[str, tuple[float, float] | None]]) -> tuple[float, str]:
    """(largest relative difference of an extremum between the engines over the first batches, its tensor):
    |ort - executor| / max(|min|, |max|) per tensor, inf where a tensor is missing on one side."""
    per = tensor_deltas(executor, ort)
    where = max(per, key=lambda k: per[k], default="")
    return (per[where] if where else 0.0), where


def with_extrema(noise: Mapping[str, NoiseProfile], executor: Mapping[str, tuple[float, float]],
                 ort: Sequence[Mapping[str, tuple[float, float] | None]]) -> dict[str, NoiseProfile]:
    """The profiles with each tensor's extrema over all first batches compared too (the elementwise comparison
    covered the first batch only)."""
    merged = _merged(ort)
    out = dict(noise)
    for name, profile in noise.items():
        a, b = executor.get(name), merged.get(name)
        if a is not None and b is not None:
            profile = profile.with_point(abs(a[0]), abs(a[0] - b[0])).with_point(abs(a[1]), abs(a[1] - b[1]))
            out[name] = profile
    return out


def _merged(ort: Sequence[Mapping[str, tuple[float, float] | None]]) -> dict[str, tuple[float, float]]:
    merged: dict[str, tuple[float, float]] = {}
    for per_batch in ort:
        for name, e in per_batch.items():
            if e is None:
                continue
            old = merged.get(name)
            merged[name] = e if old is None else (min(old[0], e[0]), max(old[1], e[1]))
    return merged


def tensor_deltas(executor: Mapping[str, tuple[float, float]],
                  ort: Sequence[Mapping[str, tuple[float, float] | None]]) -> dict[str, float]:
    """{tensor: relative difference of its extrema between the engines over the first batches} (first_batch_delta)."""
    merged = _merged(ort)
    per: dict[str, float] = {}
    for name in sorted(executor.keys() | merged.keys()):
        a, b = executor.get(name), merged.get(name)
        if a is None or b is None:
            per[name] = math.inf
            continue
        scale = max(abs(a[0]), abs(a[1]), FLOAT32_TINY)
        per[name] = max(abs(a[0] - b[0]), abs(a[1] - b[1])) / scale
    return per


@dataclass
class LaterBatches:
    """onnxruntime's per-batch (min, max) of each observed tensor over the batches after the first ones."""

    per_tensor: dict[str, list[tuple[int, float, float]]] = field(default_factory=dict)  # name -> (batch, lo, hi)

    def add(self, index: int, extrema: Mapping[str, tuple[float, float] | None]) -> None:
        for name, e in extrema.items():
            if e is not None:
                self.per_tensor.setdefault(name, []).append((index, e[0], e[1]))

    def undecided_batches(self, first: Mapping[str, tuple[float, float]], delta: float, bits: int,
                          floors: Mapping[str, float], noise: Mapping[str, NoiseProfile] | None = None,
                          exact_tensors: frozenset[str] = frozenset()) -> dict[str, set[int]]:
        """{tensor: batch indices the executor must run} for the range ends onnxruntime leaves undecided (floors:
        value_floors). An end's margin is NOISE_SAFETY x the tensor's difference between the engines at the end's
        magnitude (noise: passes.calib_noise, measured on the first batch; where not measured, delta, the largest
        relative extremum difference of any tensor, x the tensor's magnitude); exact_tensors (graph inputs, read
        from the batch itself) have none."""
        need: dict[str, set[int]] = {}
        noise = noise or {}
        for name, rows in self.per_tensor.items():
            if name in exact_tensors:
                continue
            exact = first.get(name)
            lo_mag = max([abs(lo) for _, lo, _ in rows] + ([abs(exact[0])] if exact else []))
            hi_mag = max([abs(hi) for _, _, hi in rows] + ([abs(exact[1])] if exact else []))
            profile = noise.get(name)
            if profile is None:
                margin_lo = margin_hi = NOISE_SAFETY * max(delta, NOISE_FLOOR) * max(lo_mag, hi_mag, FLOAT32_TINY)
            else:
                margin_lo, margin_hi = (NOISE_SAFETY * max(profile.at(2.0 * m), NOISE_FLOOR * m, FLOAT32_TINY)
                                        for m in (lo_mag, hi_mag))
            his = undecided(exact[1] if exact else None, [hi for _, _, hi in rows], margin_hi, bits)
            los = undecided(-exact[0] if exact else None, [-lo for _, lo, _ in rows], margin_lo, bits,
                            -floors.get(name, -math.inf))
            picked = {rows[i][0] for i in (*his, *los)}
            if picked:
                need[name] = picked
        return need

    def replace(self, name: str, index: int, lo: float, hi: float) -> None:
        """The executor's exact extrema of `name` on batch `index` instead of onnxruntime's."""
        self.per_tensor[name] = [(i, lo, hi) if i == index else (i, a, b) for i, a, b in self.per_tensor[name]]

    def pairs(self, name: str) -> torch.Tensor | None:
        """Every batch's (min, max) of `name` as one float32 tensor (what a min-max observer is fed)."""
        rows = self.per_tensor.get(name)
        if not rows:
            return None
        return torch.tensor([v for _, lo, hi in rows for v in (lo, hi)], dtype=torch.float32)
