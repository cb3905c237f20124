"""Thread policy (platforms.threads): the pure rule on given CPUs / quota / load, the cgroup and /proc readers on
files written here, the scope restoring the caller's torch threads, and the threads= / --threads plumbing."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import onnxruntime as ort
import pytest
import torch

from netquant.api import quantize_onnx
from netquant.errors import ConfigError
from netquant.passes.base import PassBase, PassContext
from netquant.platforms.threads import (
    apply_to_session_options,
    cgroup_quota,
    choose_threads,
    measure_busy,
    own_running,
    parse_cfs,
    parse_cpu_max,
    parse_threads,
    plan_threads,
    scoped_threads,
    thread_scope,
    usable_cpus,
)
from tests.conftest import CliInvoke
from tests.helpers.onnx_models import calib_batches, conv_relu_gemm


@pytest.mark.parametrize(("affinity", "quota", "busy", "want"), [
    (2, None, 0.0, 2),    # quiet 2-core box: both cores
    (2, None, 1.0, 1),    # one busy process per other core: 2 - ceil(0.75) = 1
    (2, None, 2.0, 1),    # every core busy: never below 1
    (2, None, 0.2, 2),    # a core busy 20% of the time still counts as free (slack 0.25)
    (2, None, 0.3, 1),    # 30%: taken, 2 - ceil(0.05) = 1
    (16, None, 3.5, 12),  # 16 - ceil(3.25) = 16 - 4
    (16, 4.0, 0.0, 4),    # cgroup quota of 4 CPUs caps a 16-CPU affinity
    (16, 2.5, 0.0, 2),    # fractional quota: floor(2.5) = 2
    (16, 0.5, 0.0, 1),    # quota under one CPU: still one thread
    (8, 4.0, 6.0, 1),     # busy beyond the quota: clamped to usable, 4 - ceil(3.75) = 0 -> 1
    (8, None, -1.0, 8),   # a negative reading counts as nothing busy
])
def test_choose_threads_hand_checked(affinity: int, quota: float | None, busy: float, want: int) -> None:
    assert choose_threads(affinity, quota, busy) == want


def test_usable_cpus() -> None:
    assert (usable_cpus(4, None), usable_cpus(4, 8.0), usable_cpus(4, 3.0), usable_cpus(0, None)) == (4, 4, 3, 1)


def test_cgroup_quota_files(tmp_path: Path) -> None:
    assert parse_cpu_max("max 100000\n") is None
    assert parse_cpu_max("150000 100000\n") == 1.5
    assert parse_cfs("-1\n", "100000\n") is None
    assert parse_cfs("200000\n", "100000\n") == 2.0
    (tmp_path / "cpu.max").write_text("300000 100000\n")  # a cgroup v2 root
    assert cgroup_quota(tmp_path) == 3.0
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_quota(v1) == 0.5
    assert cgroup_quota(tmp_path / "nothing") is None


def _tasks(root: Path, states: str) -> Path:
    """A fake /proc/self/task: one thread folder per state letter (stat lines as the kernel writes them)."""
    for i, state in enumerate(states):
        (root / str(100 + i)).mkdir(parents=True)
        (root / str(100 + i) / "stat").write_text(f"{100 + i} (py thread) {state} 1 2 3 4\n")
    return root


def test_measure_busy_from_proc_stat(tmp_path: Path) -> None:
    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nprocs_running 3\nprocs_blocked 0\n")  # us + 2 others
    online = __import__("os").cpu_count()
    us = _tasks(tmp_path / "us", "RS")  # the sampling thread running, a worker asleep
    assert measure_busy(affinity=online, samples=3, interval_s=0.0, stat=stat, tasks=us) == 2.0
    assert measure_busy(affinity=online, samples=1, interval_s=0.0, stat=tmp_path / "none", tasks=us) is None
    stat.write_text("procs_running 1\n")  # only us
    assert measure_busy(affinity=online, samples=2, interval_s=0.0, stat=stat, tasks=us) == 0.0


def test_measure_busy_leaves_out_this_process_s_spinning_workers(tmp_path: Path) -> None:
    """Two of the three runnable tasks are this process's (the sampler and an OpenMP worker spinning after the last
    torch op): one CPU is busy with other work, not two; an unreadable task folder counts the sampler alone."""
    stat = tmp_path / "stat"
    stat.write_text("procs_running 3\n")
    online = __import__("os").cpu_count()
    assert own_running(_tasks(tmp_path / "spin", "RRS")) == 2
    assert measure_busy(affinity=online, samples=2, interval_s=0.0, stat=stat, tasks=tmp_path / "spin") == 1.0
    assert own_running(tmp_path / "absent") == 0
    assert measure_busy(affinity=online, samples=1, interval_s=0.0, stat=stat, tasks=tmp_path / "absent") == 2.0


def test_own_running_sees_a_live_spinning_thread() -> None:
    """On Linux, a thread of this process spinning in torch (no GIL held) is counted running while it spins."""
    if not Path("/proc/self/task").is_dir():
        pytest.skip("no /proc/self/task here")
    import threading

    stop = threading.Event()

    def spin() -> None:
        a = torch.ones(64, 64)
        while not stop.is_set():
            a = torch.mm(a, a).clamp_(-1, 1)

    worker = threading.Thread(target=spin)
    worker.start()
    try:
        seen = max(own_running() for _ in range(200))
    finally:
        stop.set()
        worker.join()
    assert seen >= 2  # this thread and the spinning one, at some reading
    assert own_running() >= 1


def test_parse_threads() -> None:
    assert (parse_threads(None), parse_threads("auto"), parse_threads(" AUTO "), parse_threads("3"), parse_threads(2)) \
        == (None, None, None, 3, 2)
    for bad in (0, "-1", "many"):
        with pytest.raises(ConfigError, match="threads must be a positive integer or 'auto'"):
            parse_threads(bad)


def test_plan_keeps_torch_threads_when_omp_num_threads_is_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    plan = plan_threads()
    assert plan.threads == torch.get_num_threads() and "OMP_NUM_THREADS" in plan.why
    assert plan_threads(3).threads == 3  # an explicit count still wins
    monkeypatch.delenv("OMP_NUM_THREADS")
    auto = plan_threads()
    assert 1 <= auto.threads <= auto.affinity and auto.busy is not None


def test_scope_sets_and_restores_the_callers_threads() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert scoped_threads() is None
        with thread_scope(1) as n:
            assert n == 1 and torch.get_num_threads() == 1 and scoped_threads() == 1
            with thread_scope() as inner:  # nested auto scope keeps the outer count (no second measurement)
                assert inner == 1 and torch.get_num_threads() == 1
            so = ort.SessionOptions()
            apply_to_session_options(so)
            assert so.intra_op_num_threads == 1 and so.inter_op_num_threads == 1
        assert torch.get_num_threads() == 2 and scoped_threads() is None
        with pytest.raises(RuntimeError, match="boom"), thread_scope(1):
            raise RuntimeError("boom")
        assert torch.get_num_threads() == 2  # restored on errors too
        so = ort.SessionOptions()
        apply_to_session_options(so)  # outside a scope: onnxruntime's defaults (0 = its own choice)
        assert so.intra_op_num_threads == 0
    finally:
        torch.set_num_threads(before)


@dataclass
class _SeeThreads(PassBase):
    """Records torch's intra-op threads while the quantization passes run."""

    seen: list[int]
    name: ClassVar[str] = "see threads"

    def run(self, ctx: PassContext) -> None:
        self.seen.append(torch.get_num_threads())


def test_quantize_onnx_threads_argument() -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        probe = _SeeThreads([])
        qm = quantize_onnx(conv_relu_gemm(), calib_batches((1, 3, 8, 8), 2), passes=[probe], threads=1,
                           objective=None, quiet=True)
        assert probe.seen == [1] and qm.threads == 1
        assert torch.get_num_threads() == 2  # the caller's setting is back
        with pytest.raises(ConfigError, match="threads"):
            quantize_onnx(conv_relu_gemm(), calib_batches((1, 3, 8, 8), 2), threads=0, quiet=True)
    finally:
        torch.set_num_threads(before)


def test_cli_threads_flag(run_cli: CliInvoke, conv_net_file: Path, tmp_path: Path) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        result = run_cli("quantize", conv_net_file, "--calib", "random", "--num-calib", "2", "-o", tmp_path / "a.onnx",
                         "--objective", "none", "--threads", "1")
        assert result.exit_code == 0, result.output
        assert "(1 intra-op thread)" in result.output
        assert torch.get_num_threads() == 2
        bad = run_cli("quantize", conv_net_file, "--calib", "random", "-o", tmp_path / "b.onnx", "--threads", "x")
        assert bad.exit_code == 1 and "threads must be a positive integer or 'auto'" in bad.output
        assert not (tmp_path / "b.onnx").exists()
    finally:
        torch.set_num_threads(before)


def test_doctor_reports_threads_and_advises(run_cli: CliInvoke, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    result = run_cli("doctor")
    assert result.exit_code == 0
    for row in ("affinity", "cgroup CPU quota", "busy with other work", "OMP_NUM_THREADS", "netquant intra-op threads"):
        assert row in result.output
    assert "netquant will use" in result.output
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert "OMP_NUM_THREADS=1" in run_cli("doctor").output
