"""The Fabric that created the process group destroys it at exit; a second Fabric in the same process reuses it.

Usage: python eg_owner.py OUTDIR. strategy="ddp" re-runs this script for rank 1. Each rank writes
OUTDIR/rank{N}.json (what the second Fabric saw) and, from an atexit hook that runs after fabric's own,
OUTDIR/rank{N}.exit.json (whether the group was still initialised at exit).
"""

from __future__ import annotations

import atexit
import os

import torch
import torch.distributed as dist
from _it_common import outdir_from_argv, write_json, write_pid

from fabric import Fabric


def main() -> None:
    outdir = outdir_from_argv()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    # Registered before Fabric's own hook, so it runs after it (atexit is last in, first out).
    atexit.register(lambda: write_json(outdir / f"rank{rank}.exit.json", {"initialized": dist.is_initialized()}))
    owner = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    owner.launch()
    write_pid(outdir, owner.global_rank)
    guest = Fabric(accelerator="cpu")  # finds the group the first one created
    guest.launch()
    total = guest.all_reduce(torch.tensor(1.0), reduce_op="sum")
    seen = {
        "environment": type(guest.strategy.cluster_environment).__name__,
        "strategy": type(guest.strategy).__name__,
        "world_size": guest.world_size,
        "global_rank": guest.global_rank,
        "sum": total.item(),
    }
    guest.barrier()
    del guest
    seen["alive_after_guest"] = dist.is_initialized()
    owner.barrier()
    write_json(outdir / f"rank{owner.global_rank}.json", seen)


if __name__ == "__main__":
    main()
