"""devices=[1] or [1, 3]: every rank runs on the GPU it was given, never on GPU 0, for DDP, FSDP and DeepSpeed.

Usage: python gpu_devices.py OUTDIR STRATEGY INDICES     (STRATEGY: ddp, fsdp or deepspeed; INDICES: "1" or "1,3")
Each rank writes OUTDIR/rank{N}.pt with its device, torch's current device, where its parameters and inputs live,
and its losses.
"""

from __future__ import annotations

import sys
from typing import Any

import _gpu_paths  # noqa: F401
import torch
from _it_common import outdir_from_argv
from torch import nn

from fabric import Fabric


def make_strategy(name: str) -> Any:
    if name == "deepspeed":
        from fabric.strategies import DeepSpeedStrategy

        return DeepSpeedStrategy(stage=2)
    return name


def local_devices(model: nn.Module) -> list[str]:
    tensors = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]  # FSDP: the shard
    return sorted({str(t.device) for t in tensors})


def main() -> None:
    outdir = outdir_from_argv()
    name, indices = sys.argv[2], [int(i) for i in sys.argv[3].split(",")]
    precision = "bf16-mixed" if name == "deepspeed" else "32-true"  # DeepSpeed wants a 16-bit or fp32 config
    fabric = Fabric(accelerator="cuda", strategy=make_strategy(name), devices=indices, precision=precision)
    fabric.launch()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    x = torch.randn(8, 16, device=fabric.device)
    losses = []
    for _ in range(3):
        loss = model(x).float().pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result = {
        "device": str(fabric.device),
        "current_device": torch.cuda.current_device(),
        "param_devices": local_devices(model),
        "input_device": str(x.device),
        "world_size": fabric.world_size,
        "losses": losses,
    }
    torch.save(result, outdir / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
