"""Under torchrun, rank 1 raises while rank 0 waits in an all_reduce: torchrun must end the job, non-zero.

Usage: python -m torch.distributed.run --nproc_per_node=2 --master_port=PORT to_torchrun_raise.py OUTDIR
Rank 1 writes OUTDIR/failed_at.json just before it raises; rank 0 writes OUTDIR/rank0.unexpected.json if its
all_reduce ever returns.
"""

from __future__ import annotations

import time

import torch
from _it_common import outdir_from_argv, write_json

from fabric import Fabric

MESSAGE = "integration-test-failure-5d2e: rank 1 raised under torchrun on purpose"


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cpu", strategy="ddp")
    fabric.launch()
    fabric.barrier()
    if fabric.global_rank == 1:
        time.sleep(0.5)  # let rank 0 block first
        write_json(outdir / "failed_at.json", {"time": time.time()})
        raise RuntimeError(MESSAGE)
    fabric.all_reduce(torch.ones(1))
    write_json(outdir / "rank0.unexpected.json", {"passed_collective": True})


if __name__ == "__main__":
    main()
