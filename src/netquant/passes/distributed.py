"""Calibration over torch.distributed processes: shard the batches, merge every observer exactly.

Every rank sees the whole calibration set (the same batches in the same order) and runs only its share:
the batches kept for export validation (the first ones, as in one process) run on rank 0, the others go round-robin,
batch k after them to rank k % world. After the local pass the observers of all ranks are gathered
(all_gather_object) and merged in rank order on every rank (`Observer.merge`), so every rank holds the same state.

Exact (scales bit-identical to one process on the same data) needs observers whose state depends only on the
values seen (`Observer.order_invariant`: min-max, whose merge is the min / max of the ranks'; histograms on the
power-of-two grid, merged bin by bin on their common grid, percentile / KL / MSE then computed on the merged
histogram; fixed ranges). Observers whose state depends on batching (EMA, TensorRT-grid histograms, whose bin width
comes from the first batch) are refused with a ConfigError naming the fix (grid='pow2' or minmax).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from netquant.calib.distributed import check_mergeable, merge_across_ranks
from netquant.errors import ConfigError

__all__ = ["Shard", "broadcast_from_rank0", "check_mergeable", "current_shard", "group_backend",
           "merge_observers_across_ranks", "torchrun_env"]


@dataclass(frozen=True)
class Shard:
    """This process's place in the group: rank of world."""

    rank: int
    world: int

    def owns(self, index: int, first_batches: int) -> bool:
        """Whether this rank runs calibration batch `index` (the first `first_batches` ones are rank 0's)."""
        if index < first_batches:
            return self.rank == 0
        return (index - first_batches) % self.world == self.rank


def torchrun_env() -> bool:
    """True when started by torchrun / torch.distributed.run with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def group_backend() -> str:
    """The torch.distributed backend netquant creates groups with: 'gloo' on a CPU-only torch; with CUDA there,
    'cpu:gloo,cuda:nccl' (calibration's CPU objects and tensors go through gloo, CUDA tensors, e.g. a DDP model's
    gradients on the GPU, through nccl)."""
    import torch

    return "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"


def current_shard() -> Shard:
    """The initialised default process group's (rank, world); with torchrun's variables set and no group yet, the
    group is created first (`group_backend`). ConfigError when there is neither."""
    import torch.distributed as dist

    if not dist.is_available():
        raise ConfigError("distributed=True needs torch.distributed, which this torch build lacks")
    if not dist.is_initialized():
        if not torchrun_env():
            raise ConfigError("distributed=True needs a torch.distributed process group: start with torchrun "
                              "(or `netquant quantize --nproc N`), or call torch.distributed.init_process_group "
                              "first")
        dist.init_process_group(group_backend())
    return Shard(dist.get_rank(), dist.get_world_size())


def merge_observers_across_ranks(observers: Sequence[Any]) -> None:
    """calib.distributed.merge_across_ranks into `observers` in place (every rank saw data or an empty stream)."""
    for obs, merged in zip(observers, merge_across_ranks(observers)):
        if merged is not None and merged is not obs:
            obs.__dict__.update(merged.__dict__)


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank."""
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
