"""ZeRO stage 3 with parameters and optimizer offloaded to CPU memory, on one CUDA GPU in bf16-mixed.

Usage: python ds_cuda_offload.py OUTDIR
Prints "losses decrease" when five steps on a fixed batch lower the loss, and saves and consolidates a checkpoint.
"""

from __future__ import annotations

import torch
from _it_common import outdir_from_argv
from torch import nn

from fabric import Fabric
from fabric.strategies.deepspeed import DeepSpeedStrategy
from fabric.strategies.deepspeed.checkpoint import consolidate_deepspeed


def main() -> None:
    outdir = outdir_from_argv()
    # A torch optimizer with optimizer offload needs DeepSpeed's permission (its CPUAdam would compile an op).
    strategy = DeepSpeedStrategy(
        stage=3, offload_optimizer=True, offload_parameters=True, config={"zero_force_ds_cpu_optimizer": False}
    )
    fabric = Fabric(accelerator="cuda", devices=1, strategy=strategy, precision="bf16-mixed")
    fabric.launch()
    with fabric.init_module():
        model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    model, optimizer = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    x, y = torch.randn(16, 32, device=fabric.device), torch.randint(0, 4, (16,), device=fabric.device)
    losses = []
    for _ in range(5):
        loss = nn.functional.cross_entropy(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    fabric.save(outdir / "ckpt", {"model": model, "optimizer": optimizer, "losses": losses})
    weights = consolidate_deepspeed(outdir / "ckpt")["model"]
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias"}, sorted(weights)
    print(losses)
    if losses[-1] < losses[0]:
        print("losses decrease")


if __name__ == "__main__":
    main()
