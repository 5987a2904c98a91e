"""ddp_fork / ddp_notebook with bf16-mixed on 2 GPUs: Fabric(...) must leave CUDA untouched so the fork works.

Usage: python gpu_fork.py OUTDIR STRATEGY
The parent writes OUTDIR/parent.pt (whether CUDA was initialised before launching); each worker writes
OUTDIR/rank{N}.pt with its device, the autocast dtype and its losses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import _gpu_paths  # noqa: F401
import torch
from _it_common import outdir_from_argv
from torch import nn

from fabric import Fabric


def train(fabric: Fabric, outdir: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    x = torch.randn(32, 16, device=fabric.device)
    losses, dtypes = [], set()
    for _ in range(5):
        out = model(x)
        with fabric.autocast():
            dtypes.add(str((x @ x.T).dtype))
        loss = out.float().pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    result = {"device": str(fabric.device), "current_device": torch.cuda.current_device(), "losses": losses}
    result["autocast_dtypes"] = sorted(dtypes)
    torch.save(result, outdir / f"rank{fabric.global_rank}.pt")


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cuda", strategy=sys.argv[2], devices=2, precision="bf16-mixed")
    parent = {"cuda_initialised_before_launch": torch.cuda.is_initialized()}
    fabric.launch(train, outdir)
    parent["cuda_initialised_after_launch"] = torch.cuda.is_initialized()
    torch.save(parent, outdir / "parent.pt")


if __name__ == "__main__":
    main()
