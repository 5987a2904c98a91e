"""Started by `fabric run`: never calls fabric.launch(); reports ranks, sharding and an all_reduce.

Usage: fabric run [OPTIONS] cli_report.py OUTDIR [launch] [EXTRA...]
Each process writes OUTDIR/rank{global_rank}.json. With `launch` as second argument it calls fabric.launch().
"""

from __future__ import annotations

import os
import sys

import torch
from _it_common import outdir_from_argv, write_json
from torch.utils.data import DataLoader

from fabric import Fabric


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric()  # every flag comes from the command line
    if "launch" in sys.argv[2:]:
        fabric.launch()
    loader = fabric.setup_dataloaders(DataLoader(list(range(64)), batch_size=4, shuffle=False))
    samples = sorted(int(x) for batch in loader for x in batch)
    rank = fabric.global_rank
    total = fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
    write_json(
        outdir / f"rank{rank}.json",
        {
            "global_rank": rank,
            "local_rank": fabric.local_rank,
            "node_rank": fabric.node_rank,
            "world_size": fabric.world_size,
            "strategy": type(fabric.strategy).__name__,
            "precision": type(fabric.strategy.precision).__name__,
            "all_reduce_sum": total.item(),
            "samples": samples,
            "argv": sys.argv[1:],
            "cli_env": {k: v for k, v in os.environ.items() if k.startswith("FABRIC_CLI_")},
        },
    )
    fabric.barrier()


if __name__ == "__main__":
    main()
