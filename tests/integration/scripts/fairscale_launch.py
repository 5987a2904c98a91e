"""The five lines with strategy ddp_sharded (script re-run) or ddp_sharded_spawn, on 2 CPU processes.

Usage: python fairscale_launch.py OUTDIR STRATEGY
Each rank trains on its shard of a DataLoader, then replays the same batches through torch's DDP on the same group;
rank 0 writes OUTDIR/result.json: whether the weights are equal bit for bit, and what each rank saw.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from _it_common import outdir_from_argv, write_json
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def train(fabric: Fabric) -> dict[str, Any]:
    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=0.05))
    generator = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(32, 4, generator=generator), torch.randint(0, 2, (32,), generator=generator))
    loader = fabric.setup_dataloaders(DataLoader(data, batch_size=4))
    batches = []
    for x, y in loader:
        optimizer.zero_grad()
        fabric.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        batches.append((x, y))
    reference = nn.parallel.DistributedDataParallel(make_model())
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=0.05)
    for x, y in batches:
        reference_optimizer.zero_grad()
        nn.functional.cross_entropy(reference(x), y).backward()
        reference_optimizer.step()
    expected = reference.module.state_dict()
    equal = all(torch.equal(value, expected[key]) for key, value in model.state_dict().items())
    seen = fabric.all_gather(torch.tensor(len(batches))).tolist()
    return {"equal": fabric.all_reduce(torch.tensor(float(equal)), reduce_op="min").item() == 1.0, "batches": seen,
            "world_size": fabric.world_size, "strategy": type(fabric.strategy).__name__}  # fmt: skip


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cpu", devices=2, strategy=sys.argv[2])
    if sys.argv[2] == "ddp_sharded_spawn":
        result = fabric.launch(train)
    else:
        fabric.launch()
        result = train(fabric)
        fabric.strategy.teardown()
    if fabric.global_rank == 0:
        write_json(outdir / "result.json", result)


if __name__ == "__main__":
    main()
