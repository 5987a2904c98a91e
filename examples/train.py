"""The main example: a small classifier on synthetic data, trained with fabric (2 CPU processes by default).

Run:  python examples/train.py                      # 2 CPU processes over gloo
      python examples/train.py --accelerator cuda --devices 2 --precision bf16-mixed
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric


def make_data(n: int = 2048, features: int = 32, classes: int = 4) -> TensorDataset:
    """Separable synthetic data, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    w = torch.randn(features, classes, generator=generator)
    return TensorDataset(x, (x @ w).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--strategy", default="ddp")
    parser.add_argument("--devices", default="2")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    fabric = Fabric(
        accelerator=args.accelerator, strategy=args.strategy, devices=args.devices, precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(42)

    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=64, shuffle=True))

    for epoch in range(args.epochs):
        total = torch.zeros((), device=fabric.device)
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            total += loss.detach()
        mean_loss = fabric.all_reduce(total / len(loader), reduce_op="mean")
        fabric.print(f"epoch {epoch}: loss {mean_loss.item():.4f} (world size {fabric.world_size})")


if __name__ == "__main__":
    main()
