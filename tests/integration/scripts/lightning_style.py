"""A Lightning-Fabric-style script whose only change is the imports (`lightning.fabric` -> `fabric`)."""

import json
import sys
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric, seed_everything
from fabric.loggers import CSVLogger


class Counter:
    """A callback, as Lightning users write them: plain methods named after hooks."""

    def __init__(self) -> None:
        self.calls = 0

    def on_train_epoch_end(self, epoch: int) -> None:
        self.calls += 1


def main(out: Path) -> None:
    counter = Counter()
    fabric = Fabric(accelerator="cpu", devices=2, callbacks=[counter], loggers=CSVLogger(out / "logs"))
    fabric.launch()
    seed_everything(7)

    with fabric.init_module():
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)

    data = TensorDataset(torch.randn(64, 8, generator=torch.Generator().manual_seed(0)), torch.randn(64, 1))
    with fabric.rank_zero_first():
        train = fabric.setup_dataloaders(DataLoader(data, batch_size=8, shuffle=True))

    step = 0
    for epoch in range(2):
        model.train()
        for x, y in train:
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            fabric.log_dict({"loss": loss.detach(), "lr": scheduler.get_last_lr()[0]}, step=step)
            step += 1
        scheduler.step()
        fabric.call("on_train_epoch_end", epoch=epoch)
        fabric.barrier()

    state = {"model": model, "optimizer": optimizer, "step": step, "epoch": 1}
    fabric.save(out / "last.ckpt", state)
    restored = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(out / "last.ckpt", restored)
    total = fabric.all_reduce(torch.tensor(float(step)), reduce_op="sum")
    weights = fabric.all_gather(next(model.parameters()).detach())
    for logger in fabric.loggers:
        logger.finalize("success")
    fabric.print("done")
    report = {
        "rank": fabric.global_rank,
        "world_size": fabric.world_size,
        "steps": step,
        "restored_step": restored["step"],
        "remainder": sorted(remainder),
        "total_steps": total.item(),
        "replicas_equal": bool(torch.equal(weights[0], weights[1])),
        "callback_calls": counter.calls,
        "lr": optimizer.param_groups[0]["lr"],
    }
    (out / f"rank{fabric.global_rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
