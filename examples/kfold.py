"""K-fold cross-validation: a fresh model per fold, trained on k-1 folds and evaluated on the one held out.

Each fold's subsets go through fabric.setup_dataloaders, so every process trains on its own shard of the
fold; accuracies are summed over processes with fabric.all_reduce.

Run:  python examples/kfold.py --accelerator cpu --devices 2 --folds 5
      python examples/kfold.py --accelerator cuda --devices 2 --precision bf16-mixed
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from fabric import Fabric


def make_data(n: int = 1200, features: int = 20, classes: int = 3) -> TensorDataset:
    """Three Gaussian clusters with some overlap, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    centers = 0.35 * torch.randn(classes, features, generator=generator)
    labels = torch.randint(0, classes, (n,), generator=generator)
    return TensorDataset(centers[labels] + torch.randn(n, features, generator=generator), labels)


def fold_indices(n: int, folds: int, seed: int) -> list[list[int]]:
    """Split a seeded permutation of range(n) into `folds` parts of (nearly) equal size."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return [order[k::folds] for k in range(folds)]


def run_fold(fabric: Fabric, args: argparse.Namespace, train: Subset, val: Subset) -> float:
    """Train a newly initialised model on `train`; return its accuracy on `val`."""
    model = nn.Sequential(nn.Linear(20, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    model, optimizer = fabric.setup(model, optimizer)
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(train, batch_size=args.batch_size, shuffle=True), DataLoader(val, batch_size=256)
    )
    for _ in range(args.epochs):
        model.train()
        for x, y in train_loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()

    model.eval()
    counts = torch.zeros(2, device=fabric.device)  # correct, seen
    with torch.no_grad():
        for x, y in val_loader:
            counts += torch.stack([(model(x).argmax(dim=1) == y).sum(), torch.tensor(y.numel(), device=y.device)])
    # Sums, not a mean of per-process accuracies. DistributedSampler repeats a few samples when the fold does
    # not split evenly across processes; fold sizes that are a multiple of the process count avoid that.
    correct, seen = fabric.all_reduce(counts, reduce_op="sum").tolist()
    return correct / seen


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Defaults that leave the choice to fabric (and to `fabric run`): 1 process on a CPU, every GPU on a GPU machine.
    parser.add_argument("--accelerator", default="auto", help="cpu, cuda, gpu, mps or auto")
    parser.add_argument("--strategy", default="auto", help="e.g. ddp, ddp_spawn; auto: ddp for several devices")
    parser.add_argument("--devices", default="auto", help="how many devices (processes on a CPU)")
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed, 16-mixed; default: 32-true")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=5, help="epochs per fold")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    fabric = Fabric(
        accelerator=args.accelerator, strategy=args.strategy, devices=args.devices, precision=args.precision
    )
    fabric.launch()
    dataset = make_data()
    folds = fold_indices(len(dataset), args.folds, seed=0)

    accuracies = []
    for k, held_out in enumerate(folds):
        # Re-seed per fold: each fold's fresh model starts from the same initial weights on every process.
        fabric.seed_everything(42 + k, verbose=False)
        train_indices = [i for j, fold in enumerate(folds) if j != k for i in fold]
        accuracy = run_fold(fabric, args, Subset(dataset, train_indices), Subset(dataset, held_out))
        accuracies.append(accuracy)
        fabric.print(f"fold {k}: val acc {accuracy:.4f} ({len(train_indices)} train, {len(held_out)} val samples)")

    mean = sum(accuracies) / len(accuracies)
    spread = (sum((a - mean) ** 2 for a in accuracies) / len(accuracies)) ** 0.5
    fabric.print(f"{args.folds}-fold cross-validation: mean val acc {mean:.4f} +- {spread:.4f}")


if __name__ == "__main__":
    main()
