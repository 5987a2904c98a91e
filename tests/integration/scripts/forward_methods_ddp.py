"""Two DDP processes: gradients of training_step (routed automatically) and of a marked method are averaged."""

import json
import sys
from pathlib import Path

import torch
from torch import nn

from fabric import Fabric


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)

    def training_step(self, x: torch.Tensor) -> torch.Tensor:
        return self(x).sum()

    def custom_loss(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x).pow(2).sum()


def grads_equal_across_ranks(fabric: Fabric, model: nn.Module) -> bool:
    gathered = fabric.all_gather(model.layer.weight.grad)
    model.zero_grad()
    return bool(torch.equal(gathered[0], gathered[1]))


def main(out: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup(Model())
    x = torch.full((1, 2), float(fabric.global_rank + 1))  # different data per rank: unsynced grads would differ
    fabric.backward(model.training_step(x))
    step_synced = grads_equal_across_ranks(fabric, model)
    model.mark_forward_method("custom_loss")
    fabric.backward(model.custom_loss(x))
    marked_synced = grads_equal_across_ranks(fabric, model)
    report = {"training_step": step_synced, "marked": marked_synced}
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
