"""After a 2-process DDP run, each rank creates a second, single-process Fabric (as LLM libraries do to merge
weights) inside the still-running process group; the group must survive it.

Usage: python eg_second_fabric.py OUTDIR. strategy="ddp" re-runs this script for rank 1. Each rank writes
OUTDIR/rank{N}.json with what the second Fabric saw and a collective on the outer group afterwards, and, from an
atexit hook that runs after fabric's own, OUTDIR/rank{N}.exit.json.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path

import torch
import torch.distributed as dist
from _it_common import outdir_from_argv, write_json, write_pid

from fabric import Fabric


def finetune(fabric: Fabric) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 2)
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters()))
    for _ in range(2):
        loss = model(torch.full((3, 4), float(fabric.global_rank + 1))).sum()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def merge(outdir: Path, rank: int, weights: dict[str, torch.Tensor]) -> dict:
    single = Fabric(devices=1, accelerator="cpu")
    single.launch()
    model = single.setup(torch.nn.Linear(4, 2))
    model.load_state_dict(weights)
    output = model(torch.ones(1, 4))
    path = outdir / f"merged-{rank}.pt"
    single.save(path, {"model": model, "note": "merged"})
    fresh = single.setup(torch.nn.Linear(4, 2))
    remainder = single.load(path, {"model": fresh})
    return {
        "strategy": type(single.strategy).__name__,
        "world_size": single.world_size,
        "global_rank": single.global_rank,
        "group_alive": dist.is_initialized(),
        "output_matches": bool(torch.equal(fresh(torch.ones(1, 4)), output)),
        "remainder": sorted(remainder),
    }


def main() -> None:
    outdir = outdir_from_argv()
    rank = int(os.environ.get("LOCAL_RANK", 0))
    # Registered before Fabric's own hook, so it runs after it (atexit is last in, first out).
    atexit.register(lambda: write_json(outdir / f"rank{rank}.exit.json", {"initialized": dist.is_initialized()}))
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    write_pid(outdir, fabric.global_rank)
    weights = finetune(fabric)
    seen = merge(outdir, fabric.global_rank, weights)
    # The outer group still works: a collective over both ranks.
    seen["outer_sum"] = fabric.all_reduce(torch.tensor(float(fabric.global_rank + 1)), reduce_op="sum").item()
    fabric.barrier()
    write_json(outdir / f"rank{fabric.global_rank}.json", seen)


if __name__ == "__main__":
    main()
