"""single_xla on one CPU PJRT device: parity with eager CPU, XLA batches, bf16 policies, checkpoints."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch_xla  # noqa: F401 - before any backward: the autograd engine must know the XLA device
from _common import dataset, eager_cpu_weights, make_model, max_difference, report
from torch import nn

from fabric import Fabric
from fabric.plugins.io import XLACheckpointIO


def train(fabric: Fabric, epochs: int = 2) -> tuple[nn.Module, torch.optim.Optimizer, list[str]]:
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # created before setup, as users do
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset(), batch_size=8))
    devices = []
    for _ in range(epochs):
        for x, y in loader:
            devices.append(str(x.device))
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizer, devices


def main(tmp: Path) -> None:
    results: dict = {}
    fabric = Fabric(accelerator="xla", devices=1)
    model, optimizer, devices = train(fabric)
    results["strategy"] = type(fabric.strategy).__name__
    results["precision"] = type(fabric.strategy.precision).__name__
    results["device"] = str(fabric.device)
    results["batch_devices"] = sorted(set(devices))
    results["loader_type"] = type(fabric.setup_dataloaders(torch.utils.data.DataLoader(dataset())).dataloader).__name__
    trained = {k: v.cpu() for k, v in model.state_dict().items()}
    results["parity"] = max_difference(trained, eager_cpu_weights())

    fabric.save(tmp / "single.ckpt", {"model": model, "optimizer": optimizer, "step": torch.tensor(7)})
    saved = torch.load(tmp / "single.ckpt", weights_only=True)
    results["saved_devices"] = sorted({str(t.device) for t in saved["model"].values()})
    fresh = Fabric(accelerator="xla", devices=1)
    again = make_model(seed=3)
    again_opt = torch.optim.SGD(again.parameters(), lr=0.1, momentum=0.9)
    again, again_opt = fresh.setup(again, again_opt)
    state = {"model": again, "optimizer": again_opt, "step": None}
    fresh.load(tmp / "single.ckpt", state)
    results["reload"] = max_difference({k: v.cpu() for k, v in again.state_dict().items()}, trained)
    results["reload_step"] = int(state["step"])
    buffer = again_opt.state_dict()["state"][0]["momentum_buffer"]
    results["momentum_device"] = str(buffer.device)
    torch.save(trained, tmp / "trained.pt")
    # The plugin by itself (Lightning's XLACheckpointIO) also writes XLA tensors as CPU tensors.
    XLACheckpointIO().save_checkpoint({"w": torch.ones(2, device=fabric.device)}, tmp / "io.ckpt")
    results["io_devices"] = str(torch.load(tmp / "io.ckpt", weights_only=True)["w"].device)

    for precision in ("bf16-true", "bf16-mixed"):
        fabric = Fabric(accelerator="tpu", precision=precision)
        model = fabric.setup(make_model())
        inner: list[str] = []
        model.module[0].register_forward_hook(lambda module, args, out, seen=inner: seen.append(str(out.dtype)))
        x = torch.randn(3, 4, device=fabric.device)
        output = model(x)
        results[precision] = {"param": str(next(model.parameters()).dtype), "inner": inner, "output": str(output.dtype)}
        model, _, devices = train(fabric, epochs=1)
        results[precision]["finite"] = all(torch.isfinite(p.float()).all().item() for p in model.parameters())
    report(results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
