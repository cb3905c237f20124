"""Calibration samples run side by side: the executor on several Python threads, one sample each.

Where calibration runs the executor one batch at a time (stacking ruled out, onnxruntime not chosen) and the thread
policy chose the thread count (platforms.threads.sample_workers: one sample thread per usable CPU), the later batches
run on `workers` threads, each with its own Executor over the same graph and torch on one intra-op thread (the pool
sets torch's count to 1 for its lifetime and restores it; torch's ops release the GIL). Each run keeps only each observed
tensor's (min, max), as passes.calib_ort does for onnxruntime, and the min-max observers are fed those pairs at the
end, which leaves them in the state the whole tensors would.

Identical statistics: the runs are the executor's own (the same ops, one intra-op thread each), so every extremum is
bit-identical to a sequential run with one thread; no check is needed. A batch with a non-finite value is left to the
calibration's own executor (its observers say what is wrong).

Used only where a run is long enough for threads to pay (the executor's fastest first-batch run at least
MIN_RUN_S, the rest at least MIN_REST_S in all); the observers must be extrema-only (calib_ort.ort_blocker's
observer conditions).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from netquant.core.spec import Granularity
from netquant.graph.executor import Executor
from netquant.passes.calib_ort import FirstBatches

MIN_RUN_S = 0.005  # shorter runs are mostly Python (the GIL): threads would not overlap (shufflenet's 10 ms runs
# did: 6.8 ms a sample on two sample threads)
MIN_REST_S = 0.25  # the remaining batches' executor time below which the pool is not started (its threads and
# executors cost ~0.05 s)


def pool_blocker(observers: Sequence[Any], workers: int, device: str, distributed: bool, run_s: Sequence[float],
                 remaining: int) -> str | None:
    """Why the later batches do not run on sample threads (None: they do)."""
    if workers < 2:
        return "the thread policy leaves no CPU to sample threads"
    if str(device) != "cpu":
        return f"device {device}"
    if distributed:
        return "distributed calibration"
    if not run_s or remaining < 2:
        return "no later batches"
    if min(run_s) < MIN_RUN_S or min(run_s) * remaining < MIN_REST_S:
        return f"runs of {1e3 * min(run_s):.0f} ms x {remaining} batches are too short to pay for threads"
    for obs in observers:
        if obs.reads_values or not obs.order_invariant:
            return f"observer '{obs.name}' of '{obs.tensor_name}' reads more than the extrema"
        if obs.spec.granularity is not Granularity.PER_TENSOR:
            return f"observer of '{obs.tensor_name}' is per-channel on an activation"
    return None


class SamplePool:
    """Per-batch (min, max) of the observed tensors from executor runs on `workers` threads (module docstring).
    on_input / on_output: node name -> [(input or output index, tensor name)] to observe."""

    def __init__(self, graph: Any, on_input: Mapping[str, list[tuple[int, str]]],
                 on_output: Mapping[str, list[tuple[int, str]]], workers: int) -> None:
        self.graph = graph
        self.on_input = on_input
        self.on_output = on_output
        self.workers = workers
        self._local = threading.local()
        self._threads = torch.get_num_threads()  # restored by results()
        torch.set_num_threads(1)  # before the pool's threads start: each takes the count at its first op
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="netquant-calib")
        self.jobs: list[tuple[int, dict[str, Any], Future[dict[str, tuple[float, float]] | None]]] = []

    def _executor(self) -> Executor:
        ex = getattr(self._local, "executor", None)
        if ex is None:
            ex = Executor(self.graph)
            ex.add_pre_hook(self._pre)
            ex.add_post_hook(self._post)
            self._local.executor = ex
        return ex

    def _pre(self, node: Any, inputs: list[Any]) -> None:
        for i, name in self.on_input.get(node.name, ()):
            if i < len(inputs) and isinstance(inputs[i], torch.Tensor):
                self._local.record.add(name, inputs[i])

    def _post(self, node: Any, outputs: list[Any]) -> None:
        for j, name in self.on_output.get(node.name, ()):
            if j < len(outputs) and isinstance(outputs[j], torch.Tensor):
                self._local.record.add(name, outputs[j])

    def _run(self, batch: dict[str, Any]) -> dict[str, tuple[float, float]] | None:
        self._local.record = record = FirstBatches()
        with torch.no_grad():
            self._executor().run(batch)
        if not all(math.isfinite(lo) and math.isfinite(hi) for lo, hi in record.ranges.values()):
            return None
        return record.ranges

    def submit(self, index: int, batch: dict[str, Any]) -> None:
        self.jobs.append((index, batch, self._pool.submit(self._run, batch)))

    def results(self) -> list[tuple[int, dict[str, Any], dict[str, tuple[float, float]] | None]]:
        """(batch index, batch, extrema or None where a value is not finite) of every submitted batch, in order; the
        threads are shut down."""
        try:
            return [(i, b, f.result()) for i, b, f in self.jobs]
        finally:
            self.close()

    def close(self) -> None:
        """Shut the threads down (pending batches dropped) and give torch back its intra-op count; idempotent."""
        if self._threads:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self.jobs = []
            torch.set_num_threads(self._threads)
            self._threads = 0
