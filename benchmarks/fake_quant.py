"""Throughput of netquant.fake_quantize against torch's fused native fake-quant kernels.

Runs per-tensor and per-channel, forward and forward+backward, on a float32 tensor (16M elements by
default), for ROUND_HALF_EVEN (same semantics as torch: the target is >= 0.8x) and for the other
rounding policies (reported against the same torch kernel, which only rounds half-even).

    python benchmarks/fake_quant.py [--numel 16777216] [--repeats 7] [--threads 1] [--quiet]

Writes benchmarks/results/fake_quant.md (atomically) and prints it.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import Progress

import netquant.core.ops as ops
from netquant.atomic import write_text_atomic
from netquant.core import GradMode, Granularity, QuantSpec, RoundingPolicy, fake_quantize
from netquant.platforms.targets import host_info

RESULTS = Path(__file__).resolve().parent / "results" / "fake_quant.md"
CHANNELS = 256


@dataclass(frozen=True)
class Case:
    granularity: Granularity
    backward: bool
    policy: RoundingPolicy
    torch_dispatch: bool = False  # let fake_quantize hand per-tensor half-even to torch's kernel

    @property
    def label(self) -> str:
        gran = "per-tensor" if self.granularity is Granularity.PER_TENSOR else f"per-channel ({CHANNELS})"
        mode = "fwd+bwd" if self.backward else "fwd"
        kernel = " (dispatched to torch kernel)" if self.torch_dispatch else ""
        return f"{gran} | {mode} | {self.policy.name}{kernel}"


def _inputs(numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(CHANNELS, numel // CHANNELS, generator=gen) * 2
    dy = torch.randn(x.shape, generator=gen)
    scale_c = torch.rand(CHANNELS, generator=gen) * 0.02 + 0.01
    zp_c = torch.randint(-10, 10, (CHANNELS,), generator=gen, dtype=torch.int32)
    return x, dy, scale_c, zp_c, torch.tensor(0.017)


def _runner(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, dy: torch.Tensor,
            backward: bool) -> Callable[[], None]:
    if not backward:
        def fwd() -> None:
            with torch.no_grad():
                fn(x)
        return fwd
    xr = x.detach().clone().requires_grad_(True)

    def fwd_bwd() -> None:
        xr.grad = None
        fn(xr).backward(dy)
    return fwd_bwd


def _time_pair(ours: Callable[[], None], ref: Callable[[], None], repeats: int) -> tuple[float, float]:
    """Median seconds of each, interleaved so that machine noise hits both alike."""
    ours()
    ref()
    t_ours, t_ref = [], []
    for _ in range(repeats):
        for fn, acc in ((ours, t_ours), (ref, t_ref)):
            start = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - start)
    return statistics.median(t_ours), statistics.median(t_ref)


def run_case(case: Case, data, repeats: int) -> tuple[float, float]:
    x, dy, scale_c, zp_c, scale_t = data
    per_tensor = case.granularity is Granularity.PER_TENSOR
    zp_t = torch.tensor(3, dtype=torch.int32)
    if per_tensor:
        spec = QuantSpec(bits=8, symmetric=False, rounding=case.policy)
        s, z = scale_t, zp_t

        def ref_fn(t: torch.Tensor) -> torch.Tensor:
            return torch.fake_quantize_per_tensor_affine(t, scale_t, zp_t, -128, 127)
    else:
        spec = QuantSpec(bits=8, symmetric=False, rounding=case.policy, granularity=Granularity.PER_CHANNEL, axis=0)
        s, z = scale_c, zp_c

        def ref_fn(t: torch.Tensor) -> torch.Tensor:
            return torch.fake_quantize_per_channel_affine(t, scale_c, zp_c, 0, -128, 127)

    def ours_fn(t: torch.Tensor) -> torch.Tensor:
        return fake_quantize(t, s, z, spec, grad_mode=GradMode.STE_CLIP)

    saved = ops._DISPATCH_TO_TORCH
    ops._DISPATCH_TO_TORCH = case.torch_dispatch
    try:
        if case.policy is RoundingPolicy.ROUND_HALF_EVEN:  # same semantics: check equality once
            with torch.no_grad():
                assert torch.equal(ours_fn(x), ref_fn(x)), f"{case.label}: results differ from torch"
        return _time_pair(_runner(ours_fn, x, dy, case.backward), _runner(ref_fn, x, dy, case.backward), repeats)
    finally:
        ops._DISPATCH_TO_TORCH = saved


def cases() -> list[Case]:
    out = []
    for gran in (Granularity.PER_TENSOR, Granularity.PER_CHANNEL):
        for backward in (False, True):
            out.append(Case(gran, backward, RoundingPolicy.ROUND_HALF_EVEN))
            if gran is Granularity.PER_TENSOR:
                out.append(Case(gran, backward, RoundingPolicy.ROUND_HALF_EVEN, torch_dispatch=True))
    for gran in (Granularity.PER_TENSOR, Granularity.PER_CHANNEL):
        for backward in (False, True):
            for policy in RoundingPolicy:
                if policy is not RoundingPolicy.ROUND_HALF_EVEN:
                    out.append(Case(gran, backward, policy))
    return out


def render(rows: list[tuple[Case, float, float]], numel: int, threads: int, repeats: int) -> str:
    gbs = numel * 4 / 1e9
    lines = [
        "# fake_quantize vs torch fused fake-quant kernels",
        "",
        host_info().markdown(),
        f"{numel:,} float32 elements ({numel * 4 / 2**20:.0f} MiB), shape ({CHANNELS}, {numel // CHANNELS}), "
        f"per-channel axis 0; median of {repeats} interleaved runs; torch {torch.__version__}, "
        f"{threads} thread(s), {os.cpu_count()}-core shared CI machine ({platform.machine()}). "
        "Throughput = input GB/s. Reference: `torch.fake_quantize_per_tensor_affine` / "
        "`torch.fake_quantize_per_channel_affine` (half-even only; non-half-even rows compare a different "
        "rounding rule against the same kernel).",
        "",
        "| granularity | pass | rounding | netquant ms | torch ms | netquant GB/s | torch GB/s | ratio (torch time / ours) |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for case, ours, ref in rows:
        gran, mode, pol = case.label.split(" | ")
        lines.append(f"| {gran} | {mode} | {pol} | {ours * 1e3:.1f} | {ref * 1e3:.1f} | {gbs / ours:.2f} | "
                     f"{gbs / ref:.2f} | {ref / ours:.2f}x |")
    half_even = [(c, o, r) for c, o, r in rows if c.policy is RoundingPolicy.ROUND_HALF_EVEN and not c.torch_dispatch]
    worst = min(r / o for _, o, r in half_even)
    lines += ["", f"Target: >= 0.8x torch where semantics match (half-even). Worst half-even ratio: {worst:.2f}x "
              f"({'met' if worst >= 0.8 else 'NOT met'})."]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=16 * 2**20)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    data = _inputs(args.numel)
    rows = []
    todo = cases()
    with Progress(disable=args.quiet, transient=True) as progress:
        task = progress.add_task("fake_quant benchmark", total=len(todo))
        for case in todo:
            ours, ref = run_case(case, data, args.repeats)
            rows.append((case, ours, ref))
            progress.advance(task)
    text = render(rows, args.numel, args.threads, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, text)
    print(text, end="")


if __name__ == "__main__":
    main()
