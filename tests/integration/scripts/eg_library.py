"""A library that initialised torch.distributed itself creates and drops two Fabric objects in each process.

Usage: python eg_library.py OUTDIR. Two ranks start with torch.multiprocessing (forked) and call
init_process_group (gloo, explicit rank and world size, no torchrun variables). Each rank writes
OUTDIR/rank{N}.json with what each Fabric saw and whether the group survived both.
"""

from __future__ import annotations

import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _it_common import import_before_fork, write_json, write_pid

from fabric import Fabric


def use_fabric() -> dict:
    fabric = Fabric(accelerator="cpu")  # strategy and devices "auto": the existing group decides
    fabric.launch()
    module = torch.nn.Linear(2, 1)
    model, _ = fabric.setup(module, torch.optim.SGD(module.parameters()))
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum")
    seen = {
        "strategy": type(fabric.strategy).__name__,
        "environment": type(fabric.strategy.cluster_environment).__name__,
        "world_size": fabric.world_size,
        "global_rank": fabric.global_rank,
        "local_rank": fabric.local_rank,
        "sum": total.item(),
        "model": type(model).__name__,
    }
    fabric.barrier()
    return seen


def worker(rank: int, outdir: Path, port: int) -> None:
    write_pid(outdir, rank)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    first = use_fabric()
    gc.collect()  # the first Fabric is gone; dropping it must not touch the group
    second = use_fabric()
    gc.collect()
    alive = dist.is_initialized()
    dist.barrier()  # the library's own group still works
    dist.destroy_process_group()
    write_json(outdir / f"rank{rank}.json", {"first": first, "second": second, "group_alive": alive})


if __name__ == "__main__":
    from fabric.environments.default import find_free_port

    assert "MASTER_ADDR" not in os.environ and "RANK" not in os.environ
    import_before_fork()  # the group and everything fabric does still start in the ranks
    mp.start_processes(worker, args=(Path(sys.argv[1]), find_free_port()), nprocs=2, start_method="fork")
