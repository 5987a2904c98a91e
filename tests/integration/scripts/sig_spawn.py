"""`ddp_spawn` / `ddp_fork`: workers that train until a signal from the test ends them.

Usage: python sig_spawn.py OUTDIR STRATEGY. Each worker writes OUTDIR/rank{N}.pid.json once the process group
is up, then runs small all_reduces for at most RUN_SECONDS. If fabric.launch raises (a worker was killed),
the parent writes OUTDIR/result.json with the error; a KeyboardInterrupt is left to end the parent.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from _it_common import write_json, write_pid

from fabric import Fabric

RUN_SECONDS = 40  # far longer than any test waits: the signal, not the loop, must end the job


def train(fabric: Fabric, outdir: Path) -> None:
    fabric.barrier()
    write_pid(outdir, fabric.global_rank)
    deadline = time.monotonic() + RUN_SECONDS
    while time.monotonic() < deadline:
        fabric.all_reduce(torch.ones(1))
        time.sleep(0.05)
    write_json(outdir / f"rank{fabric.global_rank}.unexpected.json", {"ran_to_the_end": True})


def main() -> None:
    outdir, strategy = Path(sys.argv[1]), sys.argv[2]
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    try:
        fabric.launch(train, outdir)
    except RuntimeError as err:
        write_json(outdir / "result.json", {"raised": type(err).__name__, "message": str(err), "time": time.time()})


if __name__ == "__main__":
    main()
