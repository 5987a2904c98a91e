"""Lightning's image-classifier example loop on synthetic MNIST-shaped data, under Lightning Fabric or fabric.

    python lightning_classifier.py {lightning|fabric} OUTDIR [--configs pl:2w,0,2w] [--shuffle] [--seed-first] [--cli]

Each config is a number of DataLoader workers, with `w` when the workers are seeded
(`seed_everything(1, workers=True)`); the loop runs once per config, each time after seeding again.
A config prefixed `pl:` is seeded by Lightning's `seed_everything` whatever the Fabric: with `fabric`, that is
our Fabric with a seed recorded only in Lightning's variables (PL_GLOBAL_SEED, PL_SEED_WORKERS) as long as our
`seed_everything` has not run yet in the process, so such a config goes first.
Each rank writes OUTDIR/rank<R>.json: per config every training loss (as float.hex, so equality is
exact), the test loss of every epoch and FABRIC_GLOBAL_SEED as the loop found it; and the thread count.
The dataset adds noise from torch, `random` and numpy in __getitem__, so with DataLoader workers the
numbers depend on how the workers were seeded.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Net(nn.Module):
    """The example's convolutional classifier, with dropout: it also consumes the global torch RNG."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(2304, 32)
        self.fc2 = nn.Linear(32, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv2(F.relu(self.conv1(x)))), 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


class NoisyDigits(Dataset):
    """Fixed MNIST-shaped images and labels, plus per-item noise drawn from all three global RNGs."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, 1, 28, 28, generator=generator)
        self.labels = torch.randint(0, 10, (size,), generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        shift = 0.1 * torch.randn(1).item() + 0.1 * random.random() + 0.1 * float(np.random.rand())
        return self.images[index] + shift, self.labels[index]


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("impl", choices=["lightning", "fabric"])
    parser.add_argument("outdir", type=Path)
    parser.add_argument("--configs", default="0", help="comma-separated worker counts, `w` = seeded workers")
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--seed-first", action="store_true", help="seed before Fabric(...) and launch()")
    parser.add_argument("--cli", action="store_true", help="Fabric() with flags from the `run` command")
    parser.add_argument("--epochs", type=int, default=2)
    return parser.parse_args(argv)


def main(argv: list[str]) -> None:
    args = _parse(argv)
    if args.impl == "lightning":
        from lightning.fabric import Fabric
    else:
        from fabric import Fabric

    configs = args.configs.split(",")
    if args.seed_first:
        _seeder(args.impl, configs[0])(1, workers=configs[0].endswith("w"))
    fabric = Fabric() if args.cli else Fabric(accelerator="cpu", strategy="ddp", devices=2)
    if not args.cli:
        fabric.launch()
    result: dict[str, Any] = {"threads": torch.get_num_threads()}
    for index, config in enumerate(configs):
        if index > 0 or not args.seed_first:
            # where the example seeds: after Fabric(...)
            _seeder(args.impl, config)(1, workers=config.endswith("w"))
        result[config] = train(fabric, int(config.removeprefix("pl:").rstrip("w")), args)
        result[config]["our_seed_variable"] = os.environ.get("FABRIC_GLOBAL_SEED")  # None: only Lightning's was set
    args.outdir.mkdir(parents=True, exist_ok=True)
    (args.outdir / f"rank{fabric.global_rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _seeder(impl: str, config: str) -> Any:
    """The `seed_everything` that seeds this config: Lightning's for a `pl:` config or under Lightning."""
    if impl == "lightning" or config.startswith("pl:"):
        from lightning.fabric import seed_everything
    else:
        from fabric import seed_everything
    return seed_everything


def _fork_server(impl: str) -> Any:
    context = multiprocessing.get_context("forkserver")
    # Lightning's seeded workers unpickle its worker_init_fn, which imports `lightning` (seconds) in every worker of
    # every epoch unless the fork server has it already.
    preload = ["torch", "numpy", "lightning.fabric.utilities.seed"] if impl == "lightning" else ["torch", "numpy"]
    context.set_forkserver_preload(preload)
    return context


def train(fabric: Any, num_workers: int, args: argparse.Namespace) -> dict[str, Any]:
    """The example's loop: Adadelta, StepLR, per-batch nll_loss, an all-gathered test loss each epoch."""
    # Workers are not forked from the rank: a fork of a rank with live gloo threads deadlocked now and then (seen
    # under Lightning Fabric in CI). They come from a fork server, a fresh single-threaded process that imported
    # torch once, so each worker starts in milliseconds rather than importing torch again as a spawned one does.
    # The start method does not change the seeds a worker gets (the DataLoader seeds torch, random and numpy).
    context = _fork_server(args.impl) if num_workers else None
    train_loader = DataLoader(
        NoisyDigits(96, 123), batch_size=16, shuffle=args.shuffle, num_workers=num_workers,
        multiprocessing_context=context,
    )  # fmt: skip
    test_loader = DataLoader(NoisyDigits(64, 456), batch_size=16, num_workers=num_workers,
                             multiprocessing_context=context)  # fmt: skip
    train_loader, test_loader = fabric.setup_dataloaders(train_loader, test_loader)
    model = Net()
    optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
    model, optimizer = fabric.setup(model, optimizer)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    losses, test_losses = [], []
    for _ in range(args.epochs):
        model.train()
        for data, target in train_loader:
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            fabric.backward(loss)
            optimizer.step()
            losses.append(loss.item().hex())
        scheduler.step()
        model.eval()
        test_loss = 0.0
        with torch.no_grad():
            for data, target in test_loader:
                test_loss += F.nll_loss(model(data), target, reduction="sum").item()
        test_losses.append((fabric.all_gather(test_loss).sum() / len(test_loader.dataset)).item().hex())
    return {"losses": losses, "test_losses": test_losses}


if __name__ == "__main__":
    main(sys.argv[1:])
