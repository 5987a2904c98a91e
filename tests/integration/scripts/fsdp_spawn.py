"""FSDP with the spawn launcher: `fabric.launch(fn)` pickles the strategy into 2 new processes, which then train.

Usage: python fsdp_spawn.py OUTDIR. Writes OUTDIR/result.json: the losses of the same loop under `ddp_spawn` and
under FSDPStrategy(start_method="spawn").
"""

from __future__ import annotations

import torch
from _it_common import outdir_from_argv, write_json
from torch import nn

from fabric import Fabric
from fabric.strategies import FSDPStrategy


def train(fabric: Fabric) -> list[float]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = fabric.setup_module(model)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(fabric.global_rank)
    losses = []
    for _ in range(3):
        x = torch.randn(8, 4, generator=generator)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return losses


def main() -> None:
    outdir = outdir_from_argv()
    results = {}
    for name, strategy in (("ddp", "ddp_spawn"), ("fsdp", FSDPStrategy(start_method="spawn"))):
        fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
        results[name] = fabric.launch(train)
    write_json(outdir / "result.json", results)


if __name__ == "__main__":
    main()
