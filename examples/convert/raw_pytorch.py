"""A plain PyTorch training loop: a small classifier on synthetic data (compare with with_fabric.py).

Run:  python examples/convert/raw_pytorch.py --epochs 5
"""

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


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

    torch.manual_seed(42)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(make_data(), batch_size=args.batch_size, shuffle=True)

    for epoch in range(args.epochs):
        total, batches = 0.0, 0
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total, batches = total + loss.item(), batches + 1
        print(f"epoch {epoch}: loss {total / batches:.4f}")


if __name__ == "__main__":
    main()
