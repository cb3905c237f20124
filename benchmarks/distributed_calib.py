"""Distributed calibration: 1 vs N local gloo processes on the same data, scales compared bit for bit.

Each configuration runs in fresh processes: rank r joins a gloo group (torch.multiprocessing spawn) and calls
quantize_onnx(model, batches, distributed=True, objective=None) on the same batches; it reports its calibration
seconds (QuantizedModel.timings['calibration']), executor runs and peak RSS. Calibration throughput = samples /
the slowest rank's calibration seconds. Scales and zero points of every rank are compared with the one-process
run's. PP-OCR direction classifier, 512 samples in batches of 16 (uniform noise: the data does not matter for
time), minmax and percentile (pow2 grid) observers, one torch thread per process.

QAT under DistributedDataParallel: the digits CNN of benchmarks/qat_digits.py (FP32 training, BN folded, W4A4 MSE
PTQ on 512 training images, then 6 epochs of LSQ QAT, Adam lr 1e-3 cosine, global batch 32) in 1 process and in N
processes, each rank taking its share of every global batch (same optimisation up to summation order); test
accuracy of rank 0's model, seeds 0-2.

    python benchmarks/distributed_calib.py [--nprocs 1,2] [--samples 512] [--qat-seeds 0,1,2] [--out FILE]
        [--backend gloo|nccl|cpu:gloo,cuda:nccl] [--qat-device cpu|cuda]

Writes benchmarks/results/distributed.md (or --out). With --backend naming nccl, calibration still runs on the CPU
(the observers' objects travel through the group); --qat-device cuda trains each rank's model on its GPU
(rank % the GPUs there) under DDP, which nccl needs one GPU per rank for.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

RESULTS = Path(__file__).parent / "results" / "distributed.md"
OBSERVERS = {"minmax": {"activation_observer": "minmax"},
             "percentile (pow2 grid)": {"activation_observer": "percentile",
                                        "observer_options": {"percentile": {"grid": "pow2"}}}}


def _batches(n: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    return [{"x": rng.random((min(16, n - i), 3, 48, 192), dtype=np.float32) * 2 - 1} for i in range(0, n, 16)]


def _params(qm: Any) -> dict[str, tuple[Any, Any]]:
    return {f"{oc.op.name}/{k}{i}": (c.params.scale.clone(), c.params.zero_point.clone())
            for oc in qm.qgraph.op_configs.values() for k, cfgs in (("in", oc.inputs), ("out", oc.outputs))
            for i, c in enumerate(cfgs) if c is not None and c.params is not None}


def _rank(rank: int, world: int, port: int, samples: int, observer: str, backend: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    import netquant
    from netquant.api import zoo

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "nccl" in backend:
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        qm = netquant.quantize_onnx(str(zoo.ppocr_model_path("cls")), _batches(samples), distributed=world > 1,
                                    objective=None, quiet=True, threads=1, **OBSERVERS[observer])
        torch.save({"params": _params(qm), "seconds": qm.timings["calibration"],
                    "runs": qm.qgraph.calibration.executor_runs,
                    "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _qat_rank(rank: int, world: int, port: int, seeds: list[int], epochs: int, backend: str, device: str,
              out: str) -> None:
    import time

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    import netquant.nn as nqnn
    from netquant.core.ops import GradMode

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from qat_digits import DigitsCNN, accuracy, digits_data, netquant_ptq, train

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if device == "cuda":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    dist.init_process_group(backend, rank=rank, world_size=world)
    torch.set_num_threads(1)
    results = []
    try:
        for seed in seeds:
            torch.manual_seed(seed)
            x_tr, y_tr, x_te, y_te = digits_data(seed)
            fp32 = train(DigitsCNN(), x_tr, y_tr, epochs=12, lr=2e-3, seed=seed)  # identical on every rank
            folded = nqnn.fold_batchnorm(fp32)
            q = netquant_ptq(folded, nqnn.ModelQuantConfig.w4a4(activation_observer="mse"), x_tr[:512])
            nqnn.prepare_qat(q, grad_mode=GradMode.LSQ)
            fp32_accuracy = accuracy(fp32, x_te, y_te)
            if device == "cuda":
                q = q.cuda()
                x_tr, y_tr, x_te, y_te = x_tr.cuda(), y_tr.cuda(), x_te.cuda(), y_te.cuda()
            model = DistributedDataParallel(q) if world > 1 or device == "cuda" else q
            gen = torch.Generator().manual_seed(seed)
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs * ((len(x_tr) + 31) // 32))
            t0 = time.perf_counter()
            q.train()
            for _ in range(epochs):
                order = torch.randperm(len(x_tr), generator=gen)  # the same global order on every rank
                for i in range(0, len(x_tr), 32):
                    idx = order[i:i + 32][rank::world]  # this rank's share of the global batch
                    opt.zero_grad()
                    nn.functional.cross_entropy(model(x_tr[idx]), y_tr[idx]).backward()
                    opt.step()
                    sched.step()
            seconds = time.perf_counter() - t0
            results.append({"seed": seed, "fp32": fp32_accuracy, "qat": accuracy(q, x_te, y_te),
                            "seconds": seconds})
        if rank == 0:
            torch.save(results, Path(out) / "qat.pt")
    finally:
        dist.destroy_process_group()


def _spawn(fn: Any, world: int, *args: Any) -> str:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    tmp = tempfile.mkdtemp()
    mp.spawn(fn, args=(world, port, *args, tmp), nprocs=world, join=True)
    return tmp


def run(world: int, samples: int, observer: str, backend: str = "gloo") -> list[dict[str, Any]]:
    import torch

    tmp = _spawn(_rank, world, samples, observer, backend)
    return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world)]


def main() -> None:
    import torch

    from netquant.atomic import write_text_atomic
    from netquant.platforms.targets import host_info

    ap = argparse.ArgumentParser()
    ap.add_argument("--nprocs", default="1,2")
    ap.add_argument("--samples", type=int, default=512)
    ap.add_argument("--qat-seeds", default="0,1,2")
    ap.add_argument("--qat-epochs", type=int, default=6)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--backend", default="gloo", help="torch.distributed backend of every group")
    ap.add_argument("--qat-device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    src = str(Path(__file__).resolve().parents[1] / "src")
    os.environ["PYTHONPATH"] = src + os.pathsep + os.environ.get("PYTHONPATH", "")
    sys.path.insert(0, src)
    rows = []
    for observer in OBSERVERS:
        base: dict[str, Any] | None = None
        for world in map(int, args.nprocs.split(",")):
            ranks = run(world, args.samples, observer, args.backend)
            if base is None:
                base = ranks[0]["params"]
            same = all(r["params"].keys() == base.keys() and all(
                torch.equal(r["params"][k][0], base[k][0]) and torch.equal(r["params"][k][1], base[k][1])
                for k in base) for r in ranks)
            slowest = max(r["seconds"] for r in ranks)
            runs = " / ".join(str(r["runs"]) for r in ranks)
            rss = " / ".join(f"{r['rss_mb']:.0f}" for r in ranks)
            rows.append(f"| {observer} | {world} | {args.samples / slowest:.0f} | {slowest:.1f} | {runs} | {rss} "
                        f"| {'yes' if same else 'NO'} |")
            print(rows[-1], flush=True)
    qat_rows = []
    seeds = [int(v) for v in args.qat_seeds.split(",") if v.strip()]
    for world in map(int, args.nprocs.split(",")) if seeds else []:
        res = torch.load(Path(_spawn(_qat_rank, world, seeds, args.qat_epochs, args.backend,
                                             args.qat_device)) / "qat.pt", weights_only=False)
        fp32 = sum(r["fp32"] for r in res) / len(res)
        qat = sum(r["qat"] for r in res) / len(res)
        per_seed = ", ".join(f"{r['qat']:.2f}" for r in res)
        qat_rows.append(f"| {world} | {fp32:.2f} | {qat:.2f} | {per_seed} "
                        f"| {sum(r['seconds'] for r in res) / len(res):.1f} |")
        print(qat_rows[-1], flush=True)
    load = os.getloadavg()
    cores = len(os.sched_getaffinity(0))
    text = (f"# Distributed calibration: 1 vs N processes (torch.distributed, {args.backend})\n\n"
            + host_info(torch_threads=1).markdown()
            + f"\nGenerated by `benchmarks/distributed_calib.py`: PP-OCR direction classifier, {args.samples} samples "
            "in batches of 16, `quantize_onnx(..., distributed=True, objective=None, threads=1)` on every rank "
            f"(torch.multiprocessing spawn, backend {args.backend}), one torch thread per process. Throughput: samples / the slowest "
            "rank's calibration seconds. Bit-identical: every scale and zero point of every rank equals the "
            "one-process run's. Peak RSS per process includes imports. Load average (1 min) at the end: "
            f"{load[0]:.1f}; the process may use {cores} cores (other jobs' load eats into them).\n\n"
            "| observer | processes | calibration samples/s | slowest rank calibration s | executor runs per rank "
            "| peak RSS MB per rank | scales bit-identical to 1 process |\n|---|---|---|---|---|---|---|\n"
            + "\n".join(rows) + "\n"
            + ("\n## W4A4 LSQ QAT under DistributedDataParallel (digits)\n\nThe digits CNN of `qat_digits.py`: FP32 "
               "training, BN folded, W4A4 PTQ (MSE calibration, 512 training images), then "
               f"{args.qat_epochs} epochs of LSQ QAT (Adam lr 1e-3, cosine, global batch 32; each DDP rank takes its "
               f"share of every global batch), on {args.qat_device}. Seeds {seeds}; test accuracy of rank 0's model (450 "
               "images).\n\n"
               "| processes | FP32 accuracy % (mean) | W4A4 QAT accuracy % (mean) | per seed | QAT seconds (mean) |\n"
               "|---|---|---|---|---|\n" + "\n".join(qat_rows) + "\n" if qat_rows else ""))
    write_text_atomic(args.out, text)
    print(text)


if __name__ == "__main__":
    main()
