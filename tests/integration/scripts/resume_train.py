"""A shuffled training loop stopped mid-epoch, saved with its loader, and resumed in new processes.

Usage: python resume_train.py OUTDIR DEVICES PHASE STOP SCENARIOS
  PHASE      first: for each scenario the uninterrupted run ("full", TOTAL steps, saving a checkpoint at the end of
             its first epoch), then a run that stops after STOP steps with fabric.save ("stop"); resume: fabric.load
             each scenario's checkpoint and train on to TOTAL; resize: resume from the epoch-boundary checkpoint
             ("boundary"), then from the mid-epoch one ("resume"), typically on another number of devices
  SCENARIOS  comma-separated STRATEGY:WORKERS, STRATEGY one of ddp, single, fsdp, deepspeed
Checkpoints go to OUTDIR/ckpt_{STRATEGY}{WORKERS} (or under $CKPT_DIR, to load one saved by another run). Each rank
writes OUTDIR/{STRATEGY}{WORKERS}_{RUN}_rank{N}.pt: what it saw (the sample indices of every batch), its final
weights and the loader's epoch counter, or {"error": traceback}.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from _it_common import outdir_from_argv
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric

SEED = 77
SAMPLES = 50  # 25 per rank on 2 ranks: 7 batches of 4, the last one short
BATCH = 4
TOTAL = 17  # steps: into the third epoch on 2 ranks


class Indexed(Dataset):
    """Sample i is (features of i, i): batches tell which samples they hold.

    Its state names the rank that saved it: a resumed rank that gets another rank's state shows it.
    """

    def __init__(self, rank: int) -> None:
        self.x = torch.randn(SAMPLES, 6, generator=torch.Generator().manual_seed(0))
        self.rank = rank
        self.restored_from: int | None = None

    def state_dict(self) -> dict[str, int]:
        return {"rank": self.rank}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.restored_from = state["rank"]

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.x[index], index


def make_fabric(strategy_name: str, devices: int) -> Fabric:
    strategy: Any = strategy_name
    if strategy_name == "deepspeed":
        from fabric.strategies.deepspeed import DeepSpeedStrategy

        strategy = DeepSpeedStrategy(stage=2)
    elif strategy_name == "single":
        strategy = "auto"
    return Fabric(accelerator="cpu", strategy=strategy, devices=devices)


def full_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    module = getattr(model, "module", model)
    out = {}
    for name, param in module.named_parameters():
        value = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name] = value.detach().clone()
    return out


def train(fabric: Fabric, workers: str, phase: str, stop: int, checkpoint: str) -> dict[str, Any]:
    fabric.seed_everything(SEED)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    dataset = Indexed(fabric.global_rank)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=BATCH, shuffle=True, num_workers=int(workers)))
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    if phase in ("resume", "boundary"):
        fabric.load(checkpoint + ("_boundary" if phase == "boundary" else ""), state)
    step = state["step"]
    seen: list[list[int]] = []
    while step < TOTAL:
        for x, index in loader:
            seen.append(index.tolist())
            loss = model(x).pow(2).mean()
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            step += 1
            if phase == "full" and step == len(loader):
                # The end of the first epoch: a checkpoint that other world sizes can resume (saving changes nothing).
                fabric.save(checkpoint + "_boundary", {**state, "step": step})
            if phase == "stop" and step == stop:
                state["step"] = step
                fabric.save(checkpoint, state)
                return {"seen": seen, "epoch": loader._epoch}
            if step == TOTAL:
                break
    # With workers the dataset's state is restored in the worker processes, not in this copy.
    restored = loader.dataloader.dataset.restored_from if workers == "0" else None
    return {"seen": seen, "weights": full_weights(model), "epoch": loader._epoch, "restored_from": restored}


def main() -> None:
    outdir = outdir_from_argv()
    devices, phase, stop = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    scenarios = [item.split(":") for item in sys.argv[5].split(",")]  # STRATEGY:WORKERS
    fabric = None
    for strategy_name, workers in scenarios:
        # One process group for every scenario: the later Fabric objects find it and join it.
        fabric = make_fabric(strategy_name, devices)
        fabric.launch()
        torch.set_num_threads(1)
        name = f"{strategy_name}{workers}"
        checkpoint = os.environ.get("CKPT_DIR", str(outdir)) + f"/ckpt_{name}"
        runs = {"first": ["full", "stop"], "resize": ["boundary", "resume"]}.get(phase, [phase])
        for run in runs:
            try:
                result = train(fabric, workers, run, stop, checkpoint)
            except Exception:
                result = {"error": traceback.format_exc()}
            torch.save(result, Path(outdir) / f"{name}_{run}_rank{fabric.global_rank}.pt")
            fabric.barrier()
    assert fabric is not None
    fabric.strategy.teardown()


if __name__ == "__main__":
    main()
