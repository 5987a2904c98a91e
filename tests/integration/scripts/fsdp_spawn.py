"""FSDP's integration run: 2 processes started by the spawn launcher, which then run every FSDP check.

Usage: python fsdp_spawn.py OUTDIR. `fabric.launch(fn)` with FSDPStrategy(start_method="spawn") pickles the
strategy into 2 new processes. There, first the same small loop trains under FSDP and, as the reference, under raw
torch DDP on the same group; rank 0's losses come back through the launcher and this process writes them to
OUTDIR/result.json. Then each rank runs fsdp_train.py's checks (CHECKS, with the spawned Fabric as the base; one
launch for all, as that script's own main would do with the script launcher) and writes OUTDIR/rank{N}.pt.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _it_common import outdir_from_argv, run_each, write_json
from fsdp_train import CHECKS, checkpoint, full_checkpoint
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fabric import Fabric
from fabric.strategies import FSDPStrategy


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def train(
    fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, backward: Callable[[Any], Any]
) -> list[float]:
    generator = torch.Generator().manual_seed(fabric.global_rank)
    losses = []
    for _ in range(3):
        x = torch.randn(8, 4, generator=generator)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).pow(2).mean()
        optimizer.zero_grad()
        backward(loss)
        optimizer.step()
        losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())
    return losses


def spawned_training(fabric: Fabric) -> dict[str, list[float]]:
    model = fabric.setup_module(make_model())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    fsdp = train(fabric, model, optimizer, fabric.backward)
    reference = DistributedDataParallel(make_model())
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    ddp = train(fabric, reference, reference_optimizer, lambda loss: loss.backward())
    return {"fsdp": fsdp, "ddp": ddp}


def run(fabric: Fabric, outdir: Path) -> dict[str, list[float]]:
    result = spawned_training(fabric)

    def call(check: Callable[..., Any]) -> Any:  # the checkpoint checks also write to OUTDIR
        return check(fabric, outdir) if check in (checkpoint, full_checkpoint) else check(fabric)

    torch.save(run_each(CHECKS, call, fabric.barrier), outdir / f"rank{fabric.global_rank}.pt")
    return result


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cpu", devices=2, strategy=FSDPStrategy(start_method="spawn"))
    write_json(outdir / "result.json", fabric.launch(run, outdir))


if __name__ == "__main__":
    main()
