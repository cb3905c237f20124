"""How many intra-op threads netquant's own work uses on this machine, and setting them around that work.

torch (and onnxruntime) default to one intra-op thread per core. On a shared host that oversubscribes: OpenMP's
fork-join waits for its slowest thread, so a [1,64,384] x [384,1152] matmul took 22 ms with 2 threads on a busy
2-core AMD EPYC and 1.6 ms with one. The policy (`choose_threads`, a pure function) is:

    usable  = min(len(sched_getaffinity), floor(cgroup CPU quota)), at least 1 (quota: cgroup v2 cpu.max or v1
              cpu.cfs_quota_us / cpu.cfs_period_us; none = unlimited)
    busy    = CPUs of `usable` the rest of the machine keeps busy, measured (`measure_busy`): the mean number of
              runnable tasks in /proc/stat (procs_running, sampled over a few ms) less this process's own running
              threads (its OpenMP workers spin for a while after each torch op: they are not other work), scaled
              by usable / online CPUs when the process may use only part of the machine
    threads = max(1, usable - ceil(busy - BUSY_SLACK))

so a CPU counts as free while others keep it busy less than BUSY_SLACK (a quarter) of the time; under torchrun each of
the LOCAL_WORLD_SIZE processes on the machine takes at most usable // LOCAL_WORLD_SIZE. An explicit count
(`threads=`, `--threads`) wins; with OMP_NUM_THREADS set, torch's current setting is kept (the user chose it).
`thread_scope` sets torch's intra-op threads for the duration of netquant's work and restores the caller's
`torch.get_num_threads()`; `scoped_threads()` is what onnxruntime sessions netquant creates inside it should use.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from netquant.errors import ConfigError

BUSY_SLACK = 0.25  # others' share of a CPU below which it still counts as free
PROBE_SAMPLES = 8  # /proc/stat readings averaged by measure_busy ...
PROBE_INTERVAL_S = 0.002  # ... this far apart (about 16 ms in all)

_active: list[int] = []  # thread counts of the thread_scope()s entered, innermost last
_auto: list[bool] = []  # per entered thread_scope: whether the policy chose its count (no threads=, no OMP_NUM_THREADS)


def choose_threads(affinity: int, quota: float | None, busy: float) -> int:
    """Intra-op threads for `affinity` CPUs this process may run on, a cgroup `quota` in CPUs (None: unlimited)
    and `busy` CPUs taken by other work (module docstring): max(1, usable - ceil(busy - BUSY_SLACK))."""
    usable = usable_cpus(affinity, quota)
    taken = max(0, math.ceil(min(max(busy, 0.0), usable) - BUSY_SLACK))
    return max(1, usable - taken)


def usable_cpus(affinity: int, quota: float | None) -> int:
    """min(affinity, floor(quota)), at least 1."""
    usable = max(1, int(affinity))
    if quota is not None and quota > 0:
        usable = min(usable, max(1, math.floor(quota + 1e-9)))
    return usable


def affinity_cpus() -> int:
    """CPUs this process may run on (sched_getaffinity; os.cpu_count where the OS lacks it)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def parse_cpu_max(text: str) -> float | None:
    """CPUs of a cgroup v2 `cpu.max` line ('QUOTA PERIOD' or 'max PERIOD'); None = unlimited."""
    parts = text.split()
    if not parts or parts[0] == "max":
        return None
    period = float(parts[1]) if len(parts) > 1 else 100000.0
    return float(parts[0]) / period if period > 0 else None


def parse_cfs(quota_us: str, period_us: str) -> float | None:
    """CPUs of a cgroup v1 cpu.cfs_quota_us / cpu.cfs_period_us pair; None (quota -1) = unlimited."""
    quota, period = float(quota_us.strip()), float(period_us.strip())
    return quota / period if quota > 0 and period > 0 else None


def cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """This process's CPU quota in CPUs from its cgroup (v2 cpu.max, else v1 cfs), None when unlimited or unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        lines = []
    v2 = next((ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")), None)
    v1 = next((ln.split(":", 2)[2] for ln in lines if ln.count(":") >= 2 and "cpu" in ln.split(":")[1].split(",")),
              None)
    candidates: list[tuple[str, Path]] = []
    if v2 is not None:
        candidates += [("v2", root / v2.lstrip("/") / "cpu.max"), ("v2", root / "cpu.max")]
    for base in ([root / "cpu" / v1.lstrip("/"), root / "cpu,cpuacct" / v1.lstrip("/")] if v1 else []) + \
            [root / "cpu", root / "cpu,cpuacct"]:
        candidates.append(("v1", base))
    for kind, path in candidates:
        try:
            if kind == "v2":
                return parse_cpu_max(path.read_text())
            return parse_cfs((path / "cpu.cfs_quota_us").read_text(), (path / "cpu.cfs_period_us").read_text())
        except (OSError, ValueError, IndexError):
            continue
    return None


def _procs_running(stat: Path) -> int | None:
    try:
        for line in stat.read_text().splitlines():
            if line.startswith("procs_running"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def own_running(tasks: Path = Path("/proc/self/task")) -> int:
    """This process's threads in state R (running or runnable): the caller's own, and any OpenMP / onnxruntime
    worker still spin-waiting after its last parallel region (OpenMP runtimes spin a while before they sleep: after
    a netquant run on an idle 2-core AMD EPYC, one worker was runnable in 40 of 90 samples over the next 0.2 s).
    0 where the folder cannot be read."""
    count = 0
    try:
        entries = list(tasks.iterdir())
    except OSError:
        return 0
    for task in entries:
        try:
            text = (task / "stat").read_text()
        except OSError:
            continue  # (a thread that ended meanwhile)
        close = text.rfind(")")
        if close >= 0 and text[close + 2:close + 3] == "R":
            count += 1
    return count


def measure_busy(affinity: int | None = None, samples: int = PROBE_SAMPLES, interval_s: float = PROBE_INTERVAL_S,
                 stat: Path = Path("/proc/stat"), tasks: Path = Path("/proc/self/task")) -> float | None:
    """CPUs kept busy by other work: the mean over the samples of runnable tasks (procs_running) less this process's
    own running threads (own_running, at least the sampling one): torch's OpenMP workers still spinning after the
    caller's last torch op are this process's, not other work; scaled by affinity / online CPUs. None where
    /proc/stat is not there (then nothing is assumed busy)."""
    readings = []
    for i in range(samples):
        if i:
            time.sleep(interval_s)
        n = _procs_running(stat)
        if n is None:
            return None
        readings.append(max(0, n - max(1, own_running(tasks))))
    others = sum(readings) / len(readings)
    online = os.cpu_count() or 1
    cpus = affinity if affinity is not None else affinity_cpus()
    return others * min(1.0, cpus / online)


@dataclass(frozen=True)
class ThreadPlan:
    """The facts behind a thread count, for `doctor` and benchmark tables."""

    affinity: int
    quota: float | None
    busy: float | None
    threads: int
    why: str
    omp_num_threads: str | None

    def lines(self) -> list[tuple[str, str]]:
        return [("CPUs this process may use (affinity)", str(self.affinity)),
                ("cgroup CPU quota", "none" if self.quota is None else f"{self.quota:g} CPUs"),
                ("CPUs busy with other work (measured)", "unknown" if self.busy is None else f"{self.busy:.2f}"),
                ("OMP_NUM_THREADS", self.omp_num_threads if self.omp_num_threads is not None else "unset"),
                ("netquant intra-op threads", f"{self.threads} ({self.why})")]


def parse_threads(value: int | str | None) -> int | None:
    """None / 'auto' -> None (the policy decides); a positive int (or its text) -> itself; else ConfigError."""
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return None
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"threads must be a positive integer or 'auto', got {value!r}") from None
    if n < 1:
        raise ConfigError(f"threads must be a positive integer or 'auto', got {value!r}")
    return n


def plan_threads(threads: int | str | None = None) -> ThreadPlan:
    """The thread count netquant uses: `threads` when given, torch's current count when OMP_NUM_THREADS is set,
    else choose_threads on this process's affinity, cgroup quota and measured load."""
    import torch

    explicit = parse_threads(threads)
    affinity = affinity_cpus()
    quota = cgroup_quota()
    omp = os.environ.get("OMP_NUM_THREADS")
    if explicit is not None:
        return ThreadPlan(affinity, quota, None, explicit, "set by threads=", omp)
    if omp is not None and omp.strip():
        return ThreadPlan(affinity, quota, None, torch.get_num_threads(), "OMP_NUM_THREADS is set: kept", omp)
    busy = measure_busy(affinity)
    n = choose_threads(affinity, quota, busy or 0.0)
    local = local_processes()
    if local > 1:  # torchrun's processes on this machine share it; each measured the others as busy or soon will
        n = max(1, min(n, usable_cpus(affinity, quota) // local))
        return ThreadPlan(affinity, quota, busy, n, f"auto: usable CPUs / {local} local processes, less those busy",
                          omp)
    return ThreadPlan(affinity, quota, busy, n, "auto: usable CPUs less those busy", omp)


def local_processes() -> int:
    """Processes of this torchrun job on this machine (LOCAL_WORLD_SIZE; 1 outside torchrun)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


def scoped_threads() -> int | None:
    """The thread count of the innermost thread_scope (None outside one): onnxruntime sessions netquant creates
    there take it as intra_op_num_threads (timing sessions keep their own single thread)."""
    return _active[-1] if _active else None


@contextlib.contextmanager
def thread_scope(threads: int | str | None = None) -> Iterator[int]:
    """Set torch's intra-op threads to plan_threads(threads) for the block, restoring the caller's count after.
    Nested scopes without an explicit count keep the outer one (one measurement per run)."""
    import torch

    if _active and parse_threads(threads) is None:
        n, auto = _active[-1], _auto[-1]
    else:
        plan = plan_threads(threads)
        n, auto = plan.threads, plan.why.startswith("auto") and local_processes() == 1
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    _active.append(n)
    _auto.append(auto)
    try:
        yield n
    finally:
        _active.pop()
        _auto.pop()
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)


def sample_workers() -> int:
    """Python threads that may each run whole calibration samples on one intra-op thread (passes.calib_pool, which
    sets torch's count to 1 while they run): inside a thread_scope whose count the policy chose (no threads=, no
    OMP_NUM_THREADS, not under torchrun), the usable CPUs; else 1. Independent runs have no fork-join barrier: on an
    idle 2-core AMD EPYC shufflenet's batch-1 runs took 6.8 ms a sample on two sample threads vs 10.7 ms on two
    intra-op threads (15.1 ms on one), and on CPUs other work keeps busy they lose only their share of the CPU, not
    the waits that made the policy take fewer intra-op threads there (vgg19, 2 busy processes: 1.5-2.0 s per sample
    on one thread, 0.9-1.0 s on two sample threads, the same CPU time per sample)."""
    if not _active or not _auto[-1]:
        return 1
    return max(1, usable_cpus(affinity_cpus(), cgroup_quota()))


def apply_to_session_options(options: object) -> None:
    """Inside a thread_scope, give an onnxruntime SessionOptions the scope's intra_op_num_threads (and one
    inter-op thread); outside one, leave onnxruntime's defaults."""
    n = scoped_threads()
    if n is not None:
        options.intra_op_num_threads = n  # type: ignore[attr-defined]
        options.inter_op_num_threads = 1  # type: ignore[attr-defined]
