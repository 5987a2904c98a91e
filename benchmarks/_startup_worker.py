"""The training script `launch_startup.py` times: start 2 CPU ranks, take one DDP step, record when each rank did.

Usage: python _startup_worker.py FRAMEWORK HOW OUTDIR
  FRAMEWORK  raw | fabric | lightning_fabric | accelerate
  HOW        for raw: torchrun (processes exist) | spawn | fork (torch.multiprocessing starts them)
             for fabric, lightning_fabric: ddp | ddp_spawn | ddp_fork (the library's launcher starts them),
             or torchrun (processes exist; strategy ddp detects them); for accelerate: torchrun
Each rank writes OUTDIR/rank{R}.json with time.time() after its imports and after its first training step,
so the caller can compare them with the moment it started the command.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.functional import cross_entropy

IMPORTED_AT = time.time()
WORLD_SIZE = 2


def _model_and_data() -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, torch.Tensor]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), torch.randn(16, 32), torch.randint(0, 10, (16,))


def _record(outdir: Path, rank: int) -> None:
    stepped = time.time()
    tmp = outdir / f".rank{rank}.tmp"
    tmp.write_text(json.dumps({"rank": rank, "imported": IMPORTED_AT, "step1": stepped, "pid": os.getpid()}))
    tmp.replace(outdir / f"rank{rank}.json")  # the caller never reads a half-written file


def _raw_rank(rank: int, outdir: Path) -> None:
    """What a raw script does in each process: join the group, wrap in DDP, one step, leave the group."""
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    model, optimizer, x, y = _model_and_data()
    ddp = DistributedDataParallel(model)
    optimizer.zero_grad()
    cross_entropy(ddp(x), y).backward()
    optimizer.step()
    _record(outdir, rank)
    del ddp  # freed after destroy_process_group, a raw DDP model can hang the process (docs/troubleshooting.md)
    dist.destroy_process_group()


def _fabric_rank(fabric: Any, outdir: Path) -> None:
    """The same step through a Fabric object (fabric or Lightning Fabric); the library leaves the group at exit."""
    model, optimizer, x, y = _model_and_data()
    model, optimizer = fabric.setup(model, optimizer)
    optimizer.zero_grad()
    fabric.backward(cross_entropy(model(x), y))
    optimizer.step()
    _record(outdir, fabric.global_rank)


def _accelerate_rank(outdir: Path) -> None:
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    model, optimizer, x, y = _model_and_data()
    model, optimizer = acc.prepare(model, optimizer)
    optimizer.zero_grad()
    acc.backward(cross_entropy(model(x), y))
    optimizer.step()
    _record(outdir, acc.process_index)
    acc.end_training()  # destroys the process group: a clean exit for gloo


def main() -> None:
    framework, how, outdir = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    if framework == "raw":
        if how == "torchrun":
            _raw_rank(int(os.environ["RANK"]), outdir)
        else:  # the caller put MASTER_ADDR / MASTER_PORT in our environment; the children inherit them
            torch.multiprocessing.start_processes(_raw_rank, (outdir,), nprocs=WORLD_SIZE, start_method=how)
    elif framework == "accelerate":
        _accelerate_rank(outdir)
    else:
        strategy = "ddp" if how == "torchrun" else how
        fabric = __import__(framework).Fabric(accelerator="cpu", strategy=strategy, devices=WORLD_SIZE)
        if how in ("ddp", "torchrun"):
            fabric.launch()  # ddp re-runs this script for rank 1; under torchrun the processes already exist
            _fabric_rank(fabric, outdir)
        else:
            fabric.launch(_fabric_rank, outdir)


if __name__ == "__main__":
    main()
