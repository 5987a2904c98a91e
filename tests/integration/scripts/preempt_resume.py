"""Preemption and exact resume together: a SIGTERM mid-epoch, fabric.preempted read at the top of the loop body or
after optimizer.step(), a save, and a resumed run that must end with the weights of the uninterrupted one.

Usage: python preempt_resume.py OUTDIR PHASE
  PHASE  stop-top / stop-after: rank 0 sends itself SIGTERM after step SIGNAL_AT; the loop reads fabric.preempted at
         the top of its body (top) or after optimizer.step() (after), saves model, optimizer and loader, and exits
         0; resume: the uninterrupted run ("full"), then each placement's run resumed from its checkpoint
Each rank writes OUTDIR/{RUN}_rank{N}.pt: the batches it trained on (sample indices), the steps and its final
weights, or {"error": traceback}.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from _it_common import outdir_from_argv
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric

SAMPLES = 42  # 21 per rank on 2 ranks: 6 batches of 4, the last one short
BATCH = 4
TOTAL = 15  # steps: into the third epoch
SIGNAL_AT = 4


class Indexed(Dataset):
    """Sample i is (features of i, i): batches tell which samples they hold."""

    def __init__(self) -> None:
        self.x = torch.randn(SAMPLES, 5, generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.x[index], index


def train(fabric: Fabric, outdir: Path, run: str, placement: str) -> dict[str, Any]:
    fabric.seed_everything(11)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    # Worker processes: the position computed on save holds their seeds and which worker gives the next batch.
    loader = fabric.setup_dataloaders(DataLoader(Indexed(), batch_size=BATCH, shuffle=True, num_workers=2))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    checkpoint = outdir / f"ckpt_{placement}"
    if run == "resume":
        fabric.load(checkpoint, state)
    seen: list[list[int]] = []
    while state["step"] < TOTAL:
        for x, index in loader:
            if placement == "top" and fabric.preempted:  # where docs/preemption.md reads it
                fabric.save(checkpoint, state)
                return {"seen": seen, "step": state["step"]}
            seen.append(index.tolist())
            fabric.backward(model(x).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            if run == "stop" and state["step"] == SIGNAL_AT and fabric.global_rank == 0:
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler would; only rank 0 gets it
            if placement == "after" and fabric.preempted:
                fabric.save(checkpoint, state)
                return {"seen": seen, "step": state["step"]}
            if state["step"] == TOTAL:
                break
    return {"seen": seen, "step": state["step"], "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def main() -> None:
    outdir = outdir_from_argv()
    phase = sys.argv[2]
    runs = [("stop", phase.split("-")[1])] if phase.startswith("stop") else [("full", "none")]
    if phase == "resume":
        runs += [("resume", "top"), ("resume", "after")]
    fabric = None
    for run, placement in runs:
        # One process group for every run: the later Fabric objects find it and join it.
        fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
        fabric.launch()
        torch.set_num_threads(1)
        try:
            result = train(fabric, outdir, run, placement)
        except Exception:
            result = {"error": traceback.format_exc()}
        torch.save(result, outdir / f"{run}-{placement}_rank{fabric.global_rank}.pt")
        fabric.barrier()
    assert fabric is not None
    fabric.strategy.teardown()


if __name__ == "__main__":
    main()
