"""Started by torchrun: processes already exist, so `fabric.launch()` must start none and just join the group.

Usage: python -m torch.distributed.run --nproc_per_node=2 --master_port=PORT launch_torchrun.py OUTDIR
Each process writes OUTDIR/rank{global_rank}_pid{pid}.json.
"""

from __future__ import annotations

import os

import torch
from _it_common import outdir_from_argv, write_json

from fabric import Fabric


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cpu", strategy="ddp")  # devices="auto": LOCAL_WORLD_SIZE decides
    fabric.launch()
    rank = fabric.global_rank
    total = fabric.all_reduce(torch.tensor(rank + 1.0), reduce_op="sum")
    write_json(
        outdir / f"rank{rank}_pid{os.getpid()}.json",
        {
            "global_rank": rank,
            "local_rank": fabric.local_rank,
            "world_size": fabric.world_size,
            "device": str(fabric.device),
            "all_reduce_sum": total.item(),
            "launcher": type(fabric.strategy.launcher).__name__,
            "pid": os.getpid(),
            "ppid": os.getppid(),
        },
    )
    fabric.barrier()


if __name__ == "__main__":
    main()
