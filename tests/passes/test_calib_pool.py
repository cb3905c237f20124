"""Calibration samples on threads (passes.calib_pool): the scales and zero points of one-by-one executor calibration,
bit for bit; the threads the policy leaves to them (platforms.threads.sample_workers)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

import netquant.passes.calib_pool as calib_pool
import netquant.passes.calibration as calibration
from netquant.api import quantize_onnx
from netquant.export.onnx_qdq import build_qdq_model
from netquant.platforms.threads import affinity_cpus, cgroup_quota, sample_workers, thread_scope, usable_cpus
from tests.helpers.export_models import conv_net
from tests.helpers.quant_params import tensor_params


def _images(n: int, seed: int = 3) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((1, 3, 16, 16)).astype(np.float32) * (1 + i % 3) for i in range(n)]


def _quantize(batches: list[Any]) -> Any:
    return quantize_onnx(conv_net(batch=1), batches, calib_engine="executor", objective=None, quiet=True, threads=1)


def test_sample_threads_give_the_one_by_one_scales(monkeypatch: pytest.MonkeyPatch) -> None:
    batches = _images(12)
    one = _quantize(batches)
    assert one.qgraph.calibration.sample_workers == 1  # threads=1: the user's count, no sample threads
    monkeypatch.setattr(calibration, "sample_workers", lambda: 2)
    monkeypatch.setattr(calib_pool, "MIN_RUN_S", 0.0)  # this small net's runs are far below the thresholds
    monkeypatch.setattr(calib_pool, "MIN_REST_S", 0.0)
    two = _quantize(batches)
    c = two.qgraph.calibration
    assert c.sample_workers == 2 and c.engine == "executor" and c.executor_runs == one.qgraph.calibration.executor_runs
    a, b = tensor_params(one), tensor_params(two)
    assert a and a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key][0], b[key][0]) and torch.equal(a[key][1], b[key][1]), key
    assert build_qdq_model(one.qgraph)[0].SerializeToString() == build_qdq_model(two.qgraph)[0].SerializeToString()


def test_the_pool_runs_torch_on_one_thread_and_gives_the_count_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sample threads each run torch on one intra-op thread (no oversubscription under a 2-thread scope), and
    the caller's count is back after the pool, also when calibration fails mid-way."""
    seen: list[int] = []

    class Spy(calib_pool.SamplePool):
        def _run(self, batch: dict[str, Any]) -> Any:
            seen.append(torch.get_num_threads())
            return super()._run(batch)

    monkeypatch.setattr(calibration, "SamplePool", Spy)
    monkeypatch.setattr(calibration, "sample_workers", lambda: 2)
    monkeypatch.setattr(calib_pool, "MIN_RUN_S", 0.0)
    monkeypatch.setattr(calib_pool, "MIN_REST_S", 0.0)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        quantize_onnx(conv_net(batch=1), _images(8), calib_engine="executor", objective=None, quiet=True, threads=2)
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2

        def broken():  # the data fails after the pool has started
            yield from _images(5)
            raise RuntimeError("reader failed")

        with pytest.raises(Exception, match="reader failed"):
            quantize_onnx(conv_net(batch=1), broken(), calib_engine="executor", objective=None, quiet=True, threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_non_finite_batch_is_left_to_the_observers(monkeypatch: pytest.MonkeyPatch) -> None:
    """A later batch with a NaN: the pool returns no extrema for it and the calibration's executor runs it, so the
    observers see the NaN as they would one by one (same outcome either way)."""
    batches = _images(8)
    batches[5] = batches[5].copy()
    batches[5][0, 0, 0, 0] = np.nan
    outcomes = []
    for workers in (1, 2):
        monkeypatch.setattr(calibration, "sample_workers", lambda w=workers: w)
        monkeypatch.setattr(calib_pool, "MIN_RUN_S", 0.0)
        monkeypatch.setattr(calib_pool, "MIN_REST_S", 0.0)
        try:
            qm = _quantize(batches)
            outcomes.append(("ok", tensor_params(qm)))
        except Exception as exc:  # noqa: BLE001 - the outcome compared: the same error text
            outcomes.append(("error", f"{type(exc).__name__}: {exc}"))
    assert outcomes[0][0] == outcomes[1][0]
    if outcomes[0][0] == "error":
        assert outcomes[0][1] == outcomes[1][1]
    else:
        a, b = outcomes[0][1], outcomes[1][1]
        assert a.keys() == b.keys() and all(torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1]) for k in a)


def test_sample_workers_follow_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    assert sample_workers() == 1  # outside a thread_scope
    with thread_scope(1):
        assert sample_workers() == 1  # an explicit count: the user's
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with thread_scope():  # the policy's count: one sample thread (on one intra-op thread) per usable CPU
        assert sample_workers() == max(1, usable_cpus(affinity_cpus(), cgroup_quota()))
        with thread_scope():  # a nested scope keeps the outer one's
            assert sample_workers() == max(1, usable_cpus(affinity_cpus(), cgroup_quota()))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with thread_scope():
        assert sample_workers() == 1
