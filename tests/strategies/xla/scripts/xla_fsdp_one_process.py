"""strategy='xla_fsdp' in one process (world size 1): training, sharded and full checkpoints, for real."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch_xla  # noqa: F401 - before any backward: the autograd engine must know the XLA device
from _common import dataset, eager_cpu_weights, make_model, max_difference, report
from torch import nn

from fabric import Fabric
from fabric.strategies import XLAFSDPStrategy


def setup(fabric: Fabric, seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = fabric.setup_module(make_model(seed))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return model, optimizer


def train(fabric: Fabric, tmp: Path) -> dict:
    results: dict = {"world_size": fabric.world_size}
    model, optimizer = setup(fabric)
    results["wrapper"] = type(model._forward_module).__name__
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(), batch_size=8))
    for _ in range(2):
        for x, y in loader:
            fabric.backward(nn.functional.mse_loss(model(x), y))
            fabric.clip_gradients(model, optimizer, max_norm=100.0)
            optimizer.step()
            optimizer.zero_grad()
    fabric.save(tmp / "sharded", {"model": model, "optimizer": optimizer, "step": 8})
    fabric.strategy._state_dict_type = "full"
    fabric.save(tmp / "full.ckpt", {"model": model, "step": 8})
    results["files"] = sorted(p.name for p in (tmp / "sharded").iterdir())
    results["full_is_file"] = (tmp / "full.ckpt").is_file()
    full = torch.load(tmp / "full.ckpt", weights_only=True)
    results["parity"] = max_difference(full["model"], eager_cpu_weights())
    results["full_step"] = full["step"]
    torch.save(full["model"], tmp / "trained.pt")
    return results


def resume(fabric: Fabric, tmp: Path) -> dict:
    model, optimizer = setup(fabric, seed=4)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(tmp / "sharded", state)
    reloaded = fabric.strategy.get_module_state_dict(model._forward_module)
    fabric.save(tmp / "resaved", {"model": model})
    original = torch.load(tmp / "sharded" / "checkpoint_rank-00000000-of-00000001.pth", weights_only=True)
    again = torch.load(tmp / "resaved" / "checkpoint_rank-00000000-of-00000001.pth", weights_only=True)
    return {
        "step": state["step"],
        "reload": max_difference(original["model"], again["model"]),
        "momentum": len(optimizer.state_dict()["state"]),
        "shard_keys": len(reloaded),
    }


def main(tmp: Path) -> None:
    results = Fabric(accelerator="xla", strategy="xla_fsdp", devices=1).launch(train, tmp)
    results["resume"] = Fabric(accelerator="xla", strategy="xla_fsdp", devices=1).launch(resume, tmp)
    nested = XLAFSDPStrategy(auto_wrap_policy={nn.Linear}, flatten_parameters=True)
    results["nested"] = Fabric(accelerator="xla", strategy=nested, devices=1).launch(train, tmp / "nested")
    report(results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
