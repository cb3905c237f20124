"""`netquant doctor`: this machine's CPU, the int8 kernel family its onnxruntime uses, and package versions."""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from netquant.cli.common import friendly_errors
from netquant.platforms.threads import ThreadPlan


def torch_default() -> int:
    """torch's intra-op thread count in this process (its default: one per core unless OMP_NUM_THREADS is set)."""
    import torch

    return torch.get_num_threads()


def thread_advice(plan: ThreadPlan, torch_threads: int) -> str:
    """One paragraph on threads: what netquant will use and what to set for other torch / onnxruntime work."""
    if plan.omp_num_threads is not None:
        return (f"OMP_NUM_THREADS={plan.omp_num_threads}: torch uses {torch_threads} intra-op threads and netquant "
                "keeps that; unset it (or pass --threads auto) to let netquant size threads to the free CPUs.")
    text = (f"netquant will use {plan.threads} intra-op thread(s) (--threads / threads= to override). ")
    if plan.threads < torch_threads:
        text += (f"torch defaults to {torch_threads} here, more than are free: OpenMP threads then wait on each "
                 f"other (a matmul ran 14x slower on a busy 2-core host). For your own torch / onnxruntime work set "
                 f"OMP_NUM_THREADS={plan.threads} or torch.set_num_threads({plan.threads}).")
    else:
        text += "Every CPU this process may use is free now; rerun doctor when the machine is busy to see the change."
    return text


@click.command()
@friendly_errors
def doctor() -> None:
    """Print the CPU, its int8 flags, onnxruntime's int8 arithmetic here (probed) and versions, for bug reports."""
    from netquant.platforms.targets import CpuTarget, host_info, needs_saturation_free_weights
    from netquant.platforms.threads import plan_threads

    host = host_info()
    table = Table(title="netquant doctor", show_header=False)
    table.add_column("what", style="bold")
    table.add_column("value", overflow="fold")
    for key, value in host.lines():
        if key != "OMP_NUM_THREADS":  # shown with the thread plan below
            table.add_row(key, value)
    plan = plan_threads()
    for key, value in plan.lines():
        table.add_row(key, value)
    Console().print(table)
    Console().print(thread_advice(plan, torch_default()), highlight=False)
    if needs_saturation_free_weights(host.target):
        Console().print("Files quantized with full-range int8 weights (--target x86-vnni / arm64) give wrong results "
                        f"on this machine; the default --target {CpuTarget.ANY.value} is safe here.", highlight=False)
