"""The loop of raw_pytorch.py, scaled with fabric: the diff between the two files is five lines and an import.

Fabric() takes its flags from `fabric run`, so the same file runs anywhere without edits:
      python examples/convert/with_fabric.py                                            # 1 process
      fabric run --accelerator cpu --devices 2 examples/convert/with_fabric.py          # 2 CPU processes
      fabric run --accelerator cuda --devices 2 --precision bf16-mixed examples/convert/with_fabric.py
Each process trains on its own shard of the data and prints its own loss.
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric


def make_data(n: int = 2048, features: int = 32, classes: int = 4) -> TensorDataset:
    """Separable synthetic data, the same in every process (its own generator, whatever the global seed)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    w = torch.randn(features, classes, generator=generator)
    return TensorDataset(x, (x @ w).argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=1e-2)
    args = parser.parse_args()
    fabric = Fabric()  # accelerator, devices, strategy and precision come from `fabric run` (defaults: auto)
    fabric.launch()

    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=args.batch_size, shuffle=True))

    for epoch in range(args.epochs):
        total, batches = 0.0, 0
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        print(f"epoch {epoch}: loss {total / batches:.4f}")


if __name__ == "__main__":
    main()
