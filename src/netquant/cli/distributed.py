"""`netquant quantize --nproc N`: calibration shared by N local processes (torch.distributed: gloo on the CPU, with
nccl beside it for CUDA tensors where CUDA is there: `passes.distributed.group_backend`).

This process is rank 0 (it loads the data, places, writes the files and prints); ranks 1..N-1 are spawned
(torch.multiprocessing) with the same calibration batches and settings, calibrate their share and exit. Under
torchrun the command runs on every rank as started (`ranks_from_torchrun`), rank 0 writing.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
from collections.abc import Iterator
from typing import Any

GROUP_TIMEOUT = datetime.timedelta(minutes=10)  # a rank that died leaves the others waiting at most this long


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _helper_rank(index: int, world: int, port: int, model: str, batches: list[Any], settings: dict[str, Any]) -> None:
    """Ranks 1..world-1: join the group, calibrate this rank's share, leave."""
    import torch.distributed as dist

    import netquant
    from netquant.passes.distributed import group_backend

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(world))
    dist.init_process_group(group_backend(), rank=index + 1, world_size=world, timeout=GROUP_TIMEOUT)
    try:
        netquant.quantize_onnx(model, batches, **settings)
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def local_group(nproc: int, model: str, batches: list[Any], settings: dict[str, Any]) -> Iterator[None]:
    """Spawn ranks 1..nproc-1 running quantize_onnx(model, batches, distributed=True, **settings) and make this
    process rank 0 of a group (`group_backend`) for the block; the helpers are joined and the group destroyed after."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from netquant.passes.distributed import group_backend

    port = _free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_WORLD_SIZE=str(nproc))
    helper_settings = {**settings, "distributed": True, "quiet": True}
    ctx = mp.start_processes(_helper_rank, args=(nproc, port, model, batches, helper_settings), nprocs=nproc - 1,
                             join=False, start_method="spawn")
    dist.init_process_group(group_backend(), rank=0, world_size=nproc, timeout=GROUP_TIMEOUT)
    try:
        yield
        while not ctx.join():
            pass
    finally:
        dist.destroy_process_group()
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        os.environ.pop("LOCAL_WORLD_SIZE", None)


def torchrun_rank() -> int | None:
    """This process's rank when started by torchrun with more than one process, else None."""
    from netquant.passes.distributed import torchrun_env

    return int(os.environ["RANK"]) if torchrun_env() else None
