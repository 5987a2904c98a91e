"""Two CPU ranks use rank_zero_only, TorchCollective, is_shared_filesystem and ThroughputMonitor.

Usage: python compat_ranks.py OUTDIR   (starts the second rank itself through fabric's ddp launcher)
"""

import json
import sys
from pathlib import Path

import torch

from fabric import Fabric
from fabric.plugins.collectives import TorchCollective
from fabric.utilities import ThroughputMonitor, is_shared_filesystem, rank_zero_only


def collectives_report(rank: int) -> dict:
    world = TorchCollective()  # no group of its own: the default group fabric.launch() created
    total = world.all_reduce(torch.tensor([rank + 1.0]), op="sum")
    from_one = world.broadcast(torch.tensor([rank * 10.0 + 5]), src=1)
    gathered = world.all_gather([torch.zeros(1), torch.zeros(1)], torch.tensor([float(rank)]))
    objects = world.all_gather_object([None, None], {"rank": rank})
    own = TorchCollective().create_group(ranks=[0, 1])
    largest = own.all_reduce(torch.tensor([float(rank)]), op="max")
    own_size = own.world_size
    own.teardown()
    world.barrier()
    return {
        "rank": world.rank, "world_size": world.world_size, "sum": total.item(), "broadcast": from_one.item(),
        "gathered": [t.item() for t in gathered], "objects": objects, "own_max": largest.item(), "own_size": own_size,
    }  # fmt: skip


def main(out: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    monitor = ThroughputMonitor(fabric, window_size=2)
    for i in (1, 2):
        monitor.update(time=float(i), batches=i, samples=4 * i)
    report = {
        "global_rank": fabric.global_rank,
        "rank_zero_only_rank": rank_zero_only.rank,
        "rank_zero_only_ran": rank_zero_only(lambda: True, default=False)(),
        "collectives": collectives_report(fabric.global_rank),
        "shared_fs": is_shared_filesystem(fabric.strategy, out),
        "throughput": monitor.compute(),
    }
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
    fabric.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
