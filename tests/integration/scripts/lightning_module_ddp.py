"""A LightningModule trained by our Fabric on 2 CPU processes (DDP): self.log, self.all_gather, self.print.

Usage: python lightning_module_ddp.py OUTDIR. Each rank writes OUTDIR/rank{N}.json.
"""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from _it_common import outdir_from_argv, write_json
from torch import nn

from fabric import Fabric
from fabric.loggers import Logger


class MemoryLogger(Logger):
    def __init__(self) -> None:
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.append(dict(metrics))

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Linear(2, 1)
        self.gathered: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.net(batch).pow(2).mean()
        self.log("loss", loss)
        self.gathered = self.all_gather(torch.tensor(float(self.fabric.global_rank))).tolist()
        return loss

    def on_train_end(self) -> None:
        self.print("training done")


def main() -> None:
    outdir = outdir_from_argv()
    logger = MemoryLogger()
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, loggers=logger)
    fabric.launch()
    torch.manual_seed(0)
    module = Regressor()
    model, optimizer = fabric.setup(module, torch.optim.SGD(module.parameters(), lr=0.1))
    for step in range(3):
        batch = torch.full((4, 2), float(fabric.global_rank + step))
        loss = model.training_step(batch, step)  # runs through DDP's forward: gradients are averaged
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    fabric.call("on_train_end")
    weights = fabric.all_gather(module.net.weight.detach())
    write_json(
        outdir / f"rank{fabric.global_rank}.json",
        {
            "logged": [m["loss"] for m in logger.metrics],
            "gathered": module.gathered,
            "replicas_equal": bool(torch.equal(weights[0], weights[1])),
            "device": str(module.device),
        },
    )
    fabric.barrier()


if __name__ == "__main__":
    main()
