"""One rank of a job whose processes a scheduler started: report what fabric made of its variables."""

import json
import sys
from pathlib import Path

import torch

from fabric import Fabric

if __name__ == "__main__":
    out, devices, num_nodes = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    fabric = Fabric(accelerator="cpu", devices=devices, num_nodes=num_nodes)
    fabric.launch()
    total = fabric.all_reduce(torch.tensor(float(fabric.global_rank)), reduce_op="sum")
    report = {
        "environment": type(fabric.strategy.cluster_environment).__name__,
        "launcher": fabric.strategy.launcher is None,
        "rank": fabric.global_rank,
        "local_rank": fabric.local_rank,
        "node_rank": fabric.node_rank,
        "world_size": fabric.world_size,
        "sum": total.item(),
    }
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))
