"""One rank of a 2-rank job started by hand, as srun would start it (nothing supervises it), for job health.

Usage: python health_job.py OUTDIR CASE
  train       both ranks train STEPS steps (DDP all_reduces in every backward), then exit normally
  early_exit  both train; rank 1 then leaves at once with os._exit(0) (no exit hooks run, its record still says
              "running"); rank 0 works on alone, with no collective, for longer than the old 5 s stale limit
Every rank writes OUTDIR/rank{N}.threads.json after setup (the names of its Python threads) and
OUTDIR/rank{N}.finished.json at its end.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from datetime import timedelta

import torch
from _it_common import outdir_from_argv, write_json, write_pid

from fabric import Fabric
from fabric.strategies import DDPStrategy

STEPS = 30
STEP_SECONDS = 0.1  # 3 s of training: several neighbour reads of the old watch (one per second)
ALONE_SECONDS = 8  # rank 0's work after rank 1 left: longer than the old stale limit (5 s)


def main() -> None:
    outdir, case = outdir_from_argv(), sys.argv[2]
    fabric = Fabric(accelerator="cpu", strategy=DDPStrategy(timeout=timedelta(seconds=60)), devices=2)
    fabric.launch()
    rank = fabric.global_rank
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    write_pid(outdir, rank)
    write_json(outdir / f"rank{rank}.threads.json", sorted(thread.name for thread in threading.enumerate()))
    for step in range(STEPS):
        fabric.backward(model(torch.full((8, 4), float(step))).sum())
        optimizer.step()
        optimizer.zero_grad()
        time.sleep(STEP_SECONDS)
    if case == "early_exit":
        if rank == 1:
            write_json(outdir / f"rank{rank}.finished.json", {"pid": os.getpid()})
            os._exit(0)  # common to dodge exit hangs: no hook runs, no "exited" is published
        deadline = time.monotonic() + ALONE_SECONDS
        while time.monotonic() < deadline:  # its own work, waiting for nobody (no DDP backward: no all_reduce)
            torch.ones(64, 64) @ torch.ones(64, 64)
            time.sleep(STEP_SECONDS)
    write_json(outdir / f"rank{rank}.finished.json", {"pid": os.getpid()})


if __name__ == "__main__":
    main()
