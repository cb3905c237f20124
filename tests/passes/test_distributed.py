"""Distributed calibration (passes.distributed) with two local gloo processes: every rank's scales equal one
process's on the same data, bit for bit; batch-dependent observers are refused with the fix named."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from netquant.api import quantize_onnx
from netquant.errors import ConfigError
from netquant.passes.distributed import Shard
from tests.helpers.export_models import conv_net
from tests.helpers.quant_params import tensor_params as _params

SETTINGS: dict[str, dict[str, Any]] = {
    "minmax": {"activation_observer": "minmax"},
    "percentile": {"activation_observer": "percentile", "observer_options": {"percentile": {"grid": "pow2"}}},
}


def _batches() -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.standard_normal((2, 3, 16, 16)).astype(np.float32) * (1 + i % 4) for i in range(11)]



def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results: dict[str, Any] = {}
        for name, settings in SETTINGS.items():
            qm = quantize_onnx(conv_net(), _batches(), distributed=True, objective=None, quiet=True, threads=1,
                               **settings)
            results[name] = (_params(qm), qm.qgraph.calibration.executor_runs, qm.rank)
        try:
            quantize_onnx(conv_net(), _batches(), distributed=True, objective=None, quiet=True, threads=1,
                          activation_observer="percentile")
            results["refused"] = ""
        except ConfigError as err:
            results["refused"] = str(err)
        torch.save(results, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_gloo_processes_give_one_process_scales(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for name, settings in SETTINGS.items():
        one = _params(quantize_onnx(conv_net(), _batches(), objective=None, quiet=True, threads=1, **settings))
        for r, got in enumerate(ranks):
            params, runs, rank = got[name]
            assert rank == r and params.keys() == one.keys() and one
            for key in one:
                assert torch.equal(params[key][0], one[key][0]) and torch.equal(params[key][1], one[key][1]), \
                    (name, r, key)
        # 11 batches: the first 3 (export validation) on rank 0, the other 8 split 4 / 4 (rank 0 stacks its 4)
        assert ranks[1][name][1] < 11 and ranks[0][name][1] < 11
    for got in ranks:
        assert "depends on how samples are split into batches" in got["refused"] and "'grid': 'pow2'" in got["refused"]


def test_shard_rule() -> None:
    a, b = Shard(0, 2), Shard(1, 2)
    assert [i for i in range(9) if a.owns(i, 3)] == [0, 1, 2, 3, 5, 7]
    assert [i for i in range(9) if b.owns(i, 3)] == [4, 6, 8]


def test_distributed_needs_a_group() -> None:
    if dist.is_initialized():
        pytest.skip("a process group exists in this process")
    with pytest.raises(ConfigError, match="torchrun"):
        quantize_onnx(conv_net(), _batches(), distributed=True, objective=None, quiet=True)


@pytest.mark.slow  # two more interpreters importing torch: ~13 s on a shared 2-core host
def test_cli_nproc_two_processes(run_cli: Any, conv_net_file: Path, tmp_path: Path) -> None:
    """`--nproc 2`: one helper rank spawned, the scales in the written params JSON equal a one-process run's."""
    np.save(tmp_path / "calib.npy", np.concatenate(_batches()[:6]))
    common = ("--calib", tmp_path / "calib.npy", "--batch-size", "1", "--objective", "none", "--threads", "1", "-q")
    two = run_cli("quantize", conv_net_file, *common, "-o", tmp_path / "two.onnx", "--json", tmp_path / "two.json",
                  "--nproc", "2")
    assert two.exit_code == 0, two.output
    one = run_cli("quantize", conv_net_file, *common, "-o", tmp_path / "one.onnx", "--json", tmp_path / "one.json")
    assert one.exit_code == 0, one.output
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "two"))
    assert a == b and (tmp_path / "two.onnx").exists()
    assert "LOCAL_WORLD_SIZE" not in os.environ


def test_groups_are_gloo_on_a_cpu_torch_and_gloo_with_nccl_where_cuda_is_there() -> None:
    from netquant.passes.distributed import group_backend

    assert group_backend() == ("cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo")
