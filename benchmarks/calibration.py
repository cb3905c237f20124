"""Calibration benchmark: observe N batches of M floats per observer, side by side with torch.ao.

Measures, in one interleaved run (every batch goes to every observer in turn, so load changes on a
shared machine hit all of them alike):

* observe throughput of each netquant observer and of torch.ao's MinMaxObserver,
  MovingAverageMinMaxObserver and HistogramObserver;
* the time to compute params from the collected state;
* the TensorRT entropy (KL) search, vectorized (ours) against a straightforward Python loop over
  candidate thresholds (pytorch-quantization's algorithm, tests/calib/trt_reference.py), on the
  same histogram, and likewise the MSE search.

Writes benchmarks/results/calibration.md (whole or not at all) and prints it.

    python benchmarks/calibration.py --batches 200 --batch-size 1000000
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from rich.progress import Progress
from torch.ao.quantization import observer as ao

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "calib"))

import trt_reference  # noqa: E402  (the loop-based peer lives with the tests that check it)

from netquant.atomic import write_text_atomic  # noqa: E402
from netquant.calib import make_observer  # noqa: E402
from netquant.calib.search import entropy_threshold_bin  # noqa: E402
from netquant.core.spec import QuantSpec  # noqa: E402
from netquant.platforms.targets import host_info  # noqa: E402


@dataclass
class Entry:
    label: str
    observe: object  # callable(x)
    params: object  # callable() -> anything
    peer: bool = False
    observe_s: float = 0.0
    params_s: float = 0.0
    result: str = ""
    extra: dict[str, float] = field(default_factory=dict)


def _ours(name: str, spec: QuantSpec, **opts: object) -> Entry:
    obs = make_observer(name, spec, tensor_name="bench", **opts)
    label = f"netquant `{name}`" + (f" ({', '.join(f'{k}={v}' for k, v in opts.items())})" if opts else "")

    def params() -> str:
        p = obs.compute_params()
        return f"amax {float(obs.amax()):.5f}, scale {float(p.scale):.6g}"

    entry = Entry(label, obs.observe, params)
    entry.extra["obs"] = obs  # type: ignore[assignment]
    return entry


def _peer(label: str, module: torch.nn.Module) -> Entry:
    def params() -> str:
        scale, zp = module.calculate_qparams()
        return f"scale {float(scale):.6g}, zp {int(zp)}"

    return Entry(label, module, params, peer=True)


def _pool(batch_size: int, seed: int) -> list[torch.Tensor]:
    """8 distinct batches, cycled: normal with a varying spread and a few outliers."""
    g = torch.Generator().manual_seed(seed)
    pool = []
    for i in range(8):
        x = torch.randn(batch_size, generator=g) * (0.8 + 0.1 * i)
        x[torch.randint(0, batch_size, (4,), generator=g)] *= 3.0
        pool.append(x)
    return pool


def _time(fn, repeat: int = 1) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def run(batches: int, batch_size: int, seed: int, quiet: bool) -> str:
    spec = QuantSpec.int8()
    entries = [
        _ours("minmax", spec),
        _ours("ema", spec),
        _ours("percentile", spec),
        _ours("kl", spec),
        _ours("kl", spec, grid="pow2"),
        _ours("mse", spec),
        _ours("hist_l2", QuantSpec.uint8_affine()),
        _peer("torch.ao MinMaxObserver", ao.MinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)),
        _peer("torch.ao MovingAverageMinMaxObserver",
              ao.MovingAverageMinMaxObserver(dtype=torch.qint8, qscheme=torch.per_tensor_symmetric)),
        _peer("torch.ao HistogramObserver", ao.HistogramObserver(bins=2048)),
    ]
    pool = _pool(batch_size, seed)
    with Progress(disable=quiet, transient=True) as progress:
        task = progress.add_task(f"observing {batches} x {batch_size:,} floats", total=batches)
        for i in range(batches):
            x = pool[i % len(pool)]
            for e in entries:
                t0 = time.perf_counter()
                e.observe(x)  # type: ignore[operator]
                e.observe_s += time.perf_counter() - t0
            progress.advance(task)
        task = progress.add_task("computing params", total=len(entries))
        for e in entries:
            e.params_s, e.result = _time(e.params)  # type: ignore[arg-type]
            progress.advance(task)

    hist_peer = next(e for e in entries if e.label == "torch.ao HistogramObserver")
    total = batches * batch_size
    rows = []
    for e in entries:
        ratio = hist_peer.observe_s / e.observe_s
        rows.append(f"| {e.label} | {e.observe_s:.2f} | {total / e.observe_s / 1e6:.0f} | {ratio:.2f}x | "
                    f"{e.params_s * 1e3:.1f} | {e.result} |")

    # ---- threshold searches on the KL observer's histogram: vectorized vs Python loop ----------
    kl_obs = next(e for e in entries if e.label == "netquant `kl`").extra["obs"]
    counts, edges = kl_obs.hist.channel(0)  # type: ignore[attr-defined]
    counts_np = counts.numpy().astype("int64")
    edges_np = edges.float().numpy()
    ours_s, i_best = _time(lambda: entropy_threshold_bin(counts), repeat=5)
    loop_s, loop_amax = _time(lambda: trt_reference.amax_entropy(counts_np, edges_np))
    ours_amax = float(edges_np[i_best])  # type: ignore[index]
    mse_obs = make_observer("mse", QuantSpec.int8(narrow_range=True))
    mse_obs.hist = kl_obs.hist  # type: ignore[attr-defined]
    mse_obs.min_val, mse_obs.max_val = kl_obs.min_val, kl_obs.max_val  # type: ignore[attr-defined]
    mse_ours_s, mse_amax = _time(lambda: mse_obs._threshold(0, counts, edges), repeat=3)
    mse_loop_s, mse_loop_amax = _time(lambda: trt_reference.amax_mse(counts_np, edges_np))
    searches = [
        f"| entropy (KL), {counts.numel()} bins, {counts.numel() - 127} candidates | {ours_s * 1e3:.1f} | "
        f"{loop_s * 1e3:.0f} | {loop_s / ours_s:.0f}x | {ours_amax:.5f} / {loop_amax:.5f} |",
        f"| MSE (narrow int8, fake_quantize), {counts.numel()} bins | {mse_ours_s * 1e3:.1f} | "
        f"{mse_loop_s * 1e3:.0f} | {mse_loop_s / mse_ours_s:.1f}x | {mse_amax:.5f} / {mse_loop_amax:.5f} |",
    ]

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    lines = [
        "# Calibration benchmark",
        "",
        host_info().markdown(),
        f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared with other jobs (load average "
        f"{load:.1f} at the end), torch {torch.__version__} with {torch.get_num_threads()} thread(s).",
        f"Data: {batches} batches x {batch_size:,} float32 values (8 distinct normal batches with outliers, cycled), "
        "per-tensor int8 (hist_l2 and torch.ao HistogramObserver: uint8 affine). Every batch is fed to every "
        "observer in turn, so load changes on the shared machine hit all of them alike.",
        "",
        "## Observe throughput and params",
        "",
        "| observer | observe total (s) | M values/s | speed vs torch.ao HistogramObserver | compute params (ms) "
        "| result |",
        "|---|---:|---:|---:|---:|---|",
        *rows,
        "",
        "Target: histogram observers observe at least 2x faster than torch.ao HistogramObserver.",
        "",
        "## Threshold search on the same histogram: vectorized vs Python loop",
        "",
        "| search | ours (ms) | Python loop (ms) | speedup | threshold ours / loop |",
        "|---|---:|---:|---:|---|",
        *searches,
        "",
        "Target: entropy search at least 10x faster than the Python loop (pytorch-quantization's algorithm, "
        "tests/calib/trt_reference.py). Command: `python benchmarks/calibration.py --batches "
        f"{batches} --batch-size {batch_size}`.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=1_000_000)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "calibration.md")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    text = run(args.batches, args.batch_size, args.seed, args.quiet)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
