"""One rank of a 2-rank job (started by hand with torchrun's variables) that goes wrong in a chosen way.

Usage: python diag_job.py OUTDIR CASE. The failing collective's error is left uncaught, so the test reads it
from stderr as the user would see it. CASE:
  sleep     rank 0 sleeps forever before the all_reduce that rank 1 waits in
  fewer     rank 1 runs one iteration fewer than rank 0 and exits
  kill      rank 1 kills itself with SIGKILL (1 s after the barrier) before the all_reduce that rank 0 waits in
  backward  rank 0 sleeps forever before a backward that rank 1 waits in (DDP's gradient all_reduce)
  inside    rank 0 sleeps forever inside its backward (before any gradient is ready); rank 1 skips the backward
            and waits in an all_reduce
  op        (debug mode) rank 0 calls all_reduce where rank 1 calls barrier
  shape     (debug mode) the ranks all_reduce tensors of different shapes
  dtype     (debug mode) the ranks all_reduce tensors of different dtypes
  gather    (debug mode) the ranks all_gather tensors of different shapes without uneven=True
  agree     (debug mode) every kind of collective, issued alike; writes OUTDIR/rankR.json with the results
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
from _it_common import outdir_from_argv, write_json, write_pid

from fabric import Fabric
from fabric.strategies import DDPStrategy


def sleep_forever() -> None:
    while True:
        time.sleep(1)


def main() -> None:
    outdir, case = outdir_from_argv(), sys.argv[2]
    fabric = Fabric(accelerator="cpu", strategy=DDPStrategy(timeout=timedelta(seconds=3)), devices=2)
    fabric.launch()
    rank = fabric.global_rank
    write_pid(outdir, rank)
    fabric.barrier()  # collective #1: both ranks are in the group
    if case == "sleep":
        if rank == 0:
            sleep_forever()
        fabric.all_reduce(torch.ones(2))  # rank 1 waits here
    elif case == "fewer":
        for _ in range(3 if rank == 0 else 2):
            fabric.all_reduce(torch.ones(2))  # collectives #2, #3 (and #4 on rank 0 only)
    elif case == "kill":
        if rank == 1:
            time.sleep(1)  # its own work; long enough for its record of the barrier to be published
            os.kill(os.getpid(), signal.SIGKILL)
        fabric.all_reduce(torch.ones(2))  # rank 0 waits here
    elif case == "backward":
        model = fabric.setup(torch.nn.Linear(2, 2))  # collective #2 (DDP broadcasts rank 0's weights)
        loss = model(torch.ones(4, 2)).sum()
        if rank == 0:
            sleep_forever()
        fabric.backward(loss)  # collective #3: rank 1 waits in DDP's gradient all_reduce
    elif case == "inside":
        model = fabric.setup(torch.nn.Linear(2, 2))  # collective #2
        loss = SleepsOnRank0.apply(model(torch.ones(4, 2))).sum()
        if rank == 0:
            fabric.backward(loss)  # collective #3 on rank 0: it never returns
        fabric.all_reduce(torch.ones(2))  # collective #3 on rank 1: it waits here
    elif case in ("op", "shape", "dtype", "gather"):
        mismatch(fabric, case)
    elif case == "agree":
        agree(fabric, outdir)


class SleepsOnRank0(torch.autograd.Function):
    """Identity; its backward sleeps forever on rank 0 (a rank stuck in its own code inside fabric.backward)."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        if int(os.environ["RANK"]) == 0:
            sleep_forever()
        return grad


def mismatch(fabric: Fabric, case: str) -> None:
    rank = fabric.global_rank
    if case == "op":
        if rank == 0:
            fabric.all_reduce(torch.ones(2))  # mismatch: op, rank 0
        else:
            fabric.barrier()  # mismatch: op, rank 1
    elif case == "shape":
        fabric.all_reduce(torch.ones(2 + rank, 3))  # mismatch: shape
    elif case == "gather":
        fabric.all_gather(torch.ones(2 - rank, 3))  # mismatch: gather shape
    else:
        fabric.all_reduce(torch.ones(2, dtype=torch.float32 if rank == 0 else torch.float64))  # mismatch: dtype


def agree(fabric: Fabric, outdir: Path) -> None:
    rank = fabric.global_rank
    model = fabric.setup(torch.nn.Linear(2, 1))
    fabric.backward(model(torch.full((3, 2), float(rank))).sum())
    total = fabric.all_reduce(torch.tensor([1.0, rank]), reduce_op="sum")
    gathered = fabric.all_gather({"a": torch.tensor(rank), "b": 3})
    # Only rank 0 holds the object: a broadcast's payload may differ, only its source must agree.
    sent = fabric.broadcast({"step": 7} if rank == 0 else None)
    fabric.barrier()
    grad = model.module.weight.grad.tolist()
    results = {"sum": total.tolist(), "a": gathered["a"].tolist(), "b": gathered["b"].tolist(), "sent": sent}
    write_json(outdir / f"rank{rank}.json", {**results, "grad": grad})


if __name__ == "__main__":
    main()
