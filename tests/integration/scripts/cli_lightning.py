"""Started by our `fabric run`: Lightning's Fabric reads the LT_* variables, then our Fabric joins the same group.

Usage: fabric run [OPTIONS] cli_lightning.py OUTDIR. Each process writes OUTDIR/rank{global_rank}.json.
"""

from __future__ import annotations

import os

import torch
from _it_common import outdir_from_argv, write_json
from lightning.fabric import Fabric as LightningFabric

from fabric import Fabric


def main() -> None:
    outdir = outdir_from_argv()
    theirs = LightningFabric()  # under LT_CLI_USED it initialises the process group at once
    ours = Fabric()  # every flag from the command; the group exists, so it is reused
    total = ours.all_reduce(torch.tensor(float(ours.global_rank + 1)), reduce_op="sum")
    write_json(
        outdir / f"rank{ours.global_rank}.json",
        {
            "lightning": [theirs.world_size, theirs.global_rank, type(theirs.strategy).__name__,
                          type(theirs.strategy.precision).__name__],
            "ours": [ours.world_size, ours.global_rank, type(ours.strategy).__name__,
                     type(ours.strategy.precision).__name__],
            "sum": total.item(),
            "lt_env": {k: v for k, v in os.environ.items() if k.startswith("LT_")},
        },
    )  # fmt: skip
    ours.barrier()


if __name__ == "__main__":
    main()
