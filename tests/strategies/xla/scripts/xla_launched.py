"""strategy='xla' with one process: torch_xla's launcher, its collectives and the optimizer step, for real."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch_xla  # noqa: F401 - before any backward: the autograd engine must know the XLA device
from _common import dataset, eager_cpu_weights, make_model, max_difference, report
from torch import nn

from fabric import Fabric


def work(fabric: Fabric, tmp: Path) -> dict:
    results: dict = {"pid_is_launcher": os.getpid() == int(os.environ["LAUNCHER_PID"])}
    results["ranks"] = [fabric.global_rank, fabric.local_rank, fabric.node_rank, fabric.world_size]
    results["device"] = str(fabric.device)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(), batch_size=8))
    results["sampler"] = type(loader.sampler).__name__
    devices = set()
    for _ in range(2):
        for x, y in loader:
            devices.add(str(x.device))
            fabric.backward(nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
    results["batch_devices"] = sorted(devices)
    trained = {k: v.cpu() for k, v in model.state_dict().items()}
    results["parity"] = max_difference(trained, eager_cpu_weights())
    value = torch.tensor([1.0, 4.0], device=fabric.device)
    results["all_reduce_mean"] = fabric.all_reduce(value).cpu().tolist()
    results["all_reduce_max"] = fabric.all_reduce(value, reduce_op="max").cpu().tolist()
    results["all_gather_shape"] = list(fabric.all_gather(value).shape)
    results["broadcast_tensor"] = fabric.broadcast(value).cpu().tolist()
    results["broadcast_object"] = fabric.broadcast({"path": "a/b", "n": [1, 2]})
    fabric.barrier("checkpoint")
    fabric.save(tmp / "xla.ckpt", {"model": model, "optimizer": optimizer})
    torch.save(trained, tmp / "trained.pt")
    return {**results, "tensor": torch.ones(2, device=fabric.device)}


def main(tmp: Path) -> None:
    os.environ["LAUNCHER_PID"] = str(os.getpid())
    fabric = Fabric(accelerator="xla", strategy="xla", devices=1)
    results = fabric.launch(work, tmp)
    results["returned_tensor_device"] = str(results.pop("tensor").device)
    results["strategy"] = type(fabric.strategy).__name__
    report(results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
