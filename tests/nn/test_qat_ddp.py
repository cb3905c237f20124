"""Module API under torch.distributed with two local gloo processes: calibrate(distributed=True) gives every rank
the one-process params bit for bit; LSQ QAT under DistributedDataParallel keeps the ranks' scales identical and
follows single-process training on the whole batch."""

from __future__ import annotations

import gc
import os
import socket
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import netquant.nn as nqnn
from netquant.core.ops import GradMode

STEPS = 8
WORLD = 2


def _problem() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(256, 8)
    y = (x[:, :4].sum(1) > x[:, 4:].sum(1)).long()
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    return model, x, y


def _scales(q: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in q.state_dict().items() if k.endswith("scale")}


def _train(q: nn.Module, step_model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    scales = [p for n, p in step_model.named_parameters() if n.endswith("scale")]
    others = [p for n, p in step_model.named_parameters() if not n.endswith("scale")]
    # a large step for the scales: activation scales move by ~1% (LSQ's 1/sqrt(numel * qmax) makes their
    # gradients small), enough to see a gradient scaled for the local instead of the global batch
    opt = torch.optim.SGD([{"params": others, "lr": 0.05}, {"params": scales, "lr": 50.0}])
    q.train()
    for _ in range(STEPS):
        opt.zero_grad()
        nn.functional.cross_entropy(step_model(x), y).backward()
        opt.step()


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    try:
        torch.set_num_threads(1)
        model, x, y = _problem()
        mine = slice(rank * 128, (rank + 1) * 128)  # each rank half of the data
        q = nqnn.quantize_model(model, nqnn.ModelQuantConfig.w4a4(activation_observer="minmax"))
        with nqnn.calibrate(q, distributed=True):
            q(x[mine])
        calibrated = _scales(q)
        nqnn.prepare_qat(q, grad_mode=GradMode.LSQ)
        ddp = DistributedDataParallel(q)
        _train(q, ddp, x[mine], y[mine])
        trained = _scales(q)
        # an uneven last global batch: rank 1's share is empty; DDP needs every scale used on every rank
        ddp.zero_grad()
        ddp(x[mine][:4] if rank == 0 else x[:0]).square().sum().backward()
        uneven = {n: p.grad.clone() for n, p in q.named_parameters() if n.endswith("scale")}
        torch.save({"calibrated": calibrated, "trained": trained, "uneven": uneven}, Path(out) / f"rank{rank}.pt")
        # release DDP's reducer (it holds the group and its pending gloo work) while the interpreter is whole, and
        # leave together: a gloo worker thread torn down at interpreter exit aborts the process (SIGABRT, seen in CI)
        del ddp
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # results saved, group left: this rank exits without interpreter finalization, where a gloo thread torn down late
    # aborts the process whatever the test computed (torch's teardown, not what is tested here)
    os._exit(0)


def test_calibration_and_lsq_qat_under_ddp(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(port, str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)]

    torch.set_num_threads(1)
    model, x, y = _problem()
    q = nqnn.quantize_model(model, nqnn.ModelQuantConfig.w4a4(activation_observer="minmax"))
    with nqnn.calibrate(q):
        q(x)  # one process, all the data
    one = _scales(q)
    assert any("input_quantizer" in k for k in one)
    for got in ranks:  # merged observers: the one-process params, bit for bit
        assert got["calibrated"].keys() == one.keys()
        assert all(torch.equal(got["calibrated"][k], one[k]) for k in one)
    nqnn.prepare_qat(q, grad_mode=GradMode.LSQ)
    _train(q, q, x, y)  # mean loss over both halves = DDP's average of the ranks' gradients
    trained = _scales(q)
    assert all(torch.equal(ranks[0]["trained"][k], ranks[1]["trained"][k]) for k in trained)  # ranks in sync
    for k in trained:  # LSQ did learn every weight and activation scale
        if "output_quantizer" not in k:  # (outputs feed no quantized op here: disabled, scale 1)
            assert float(((trained[k] - one[k]).abs() / one[k]).max()) > 1e-3, k
    for k in trained:
        torch.testing.assert_close(ranks[0]["trained"][k], trained[k], rtol=1e-4, atol=1e-7)
    uneven = ranks[0]["uneven"]  # the averaged gradients of the uneven step: the same on both ranks, not all zero
    assert uneven and all(torch.equal(uneven[k], ranks[1]["uneven"][k]) for k in uneven)
    assert any(bool(g.abs().sum() > 0) for g in uneven.values())
