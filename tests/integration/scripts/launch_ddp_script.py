"""`strategy="ddp"`: fabric re-runs this script for local rank 1; every rank reports who it is.

Usage: python launch_ddp_script.py OUTDIR ADDRESSES
Each process writes OUTDIR/rank{global_rank}_pid{pid}.json (named by pid, so extra processes would show). Then the
job probes its store on ADDRESSES (comma-separated, may be empty; see store_exposure.py), so that one job serves
both tests of `ddp`.
"""

from __future__ import annotations

import os
import sys

import torch
from _it_common import outdir_from_argv, write_json
from store_exposure import parse_addresses, probe

from fabric import Fabric


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    rank = fabric.global_rank
    total = fabric.all_reduce(torch.tensor([rank + 1.0, 10.0 * (rank + 1)]), reduce_op="sum")
    write_json(
        outdir / f"rank{rank}_pid{os.getpid()}.json",
        {
            "global_rank": rank,
            "local_rank": fabric.local_rank,
            "node_rank": fabric.node_rank,
            "world_size": fabric.world_size,
            "device": str(fabric.device),
            "is_global_zero": fabric.is_global_zero,
            "all_reduce_sum": total.tolist(),
            "argv": sys.argv[1:],
            "pid": os.getpid(),
            "ppid": os.getppid(),
        },
    )
    probe(fabric, outdir, parse_addresses(sys.argv[2]))


if __name__ == "__main__":
    main()
