"""A small CNN on synthetic 10-class images: train, evaluate each epoch, checkpoint, resume.

Each class is a stripe pattern (an angle and a width) at a random offset under heavy noise, generated in the
script with a fixed seed: a CNN learns it in a few epochs and nothing is downloaded.

Run:  python examples/image_classifier.py --accelerator cpu --devices 2
      python examples/image_classifier.py --accelerator cpu --devices 2 --epochs 4 --resume checkpoints/last.ckpt
      python examples/image_classifier.py --accelerator cuda --devices 2 --precision bf16-mixed
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric

CLASSES = 10
SIZE = 16


def make_images(n: int, seed: int) -> TensorDataset:
    """`n` noisy stripe images; the class sets the stripes' angle (5 choices) and width (2 choices)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, CLASSES, (n,), generator=generator)
    angle = (labels % 5).float() * torch.pi / 5
    frequency = torch.where(labels < 5, 1 / 8, 1 / 4) * 2 * torch.pi
    phase = torch.rand(n, generator=generator) * 2 * torch.pi  # where the stripes start: any shift is the same class
    ys, xs = torch.meshgrid(torch.arange(SIZE), torch.arange(SIZE), indexing="ij")
    along = xs * angle.cos()[:, None, None] + ys * angle.sin()[:, None, None]
    images = torch.sin(frequency[:, None, None] * along + phase[:, None, None])
    images = images + 1.5 * torch.randn(images.shape, generator=generator)
    return TensorDataset(images.unsqueeze(1), labels)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),   # 16 -> 8
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),  # 8 -> 4
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, CLASSES),
    )  # fmt: skip


def train_epoch(fabric: Fabric, model: nn.Module, optimizer: torch.optim.Optimizer, loader: DataLoader) -> float:
    model.train()
    total = torch.zeros((), device=fabric.device)
    for images, labels in loader:
        loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad()
        fabric.backward(loss)
        optimizer.step()
        total += loss.detach()
    # Every process saw a different shard: the mean over processes is the epoch's loss.
    return float(fabric.all_reduce(total / len(loader), reduce_op="mean"))


@torch.no_grad()
def evaluate(fabric: Fabric, model: nn.Module, loader: DataLoader) -> float:
    model.eval()
    correct = torch.zeros((), device=fabric.device)
    seen = torch.zeros((), device=fabric.device)
    for images, labels in loader:
        correct += (model(images).argmax(dim=1) == labels).sum()
        seen += labels.numel()
    # Sum the counts, not the per-process accuracies: the shards may differ in size.
    correct, seen = fabric.all_reduce((correct, seen), reduce_op="sum")
    return float(correct / seen)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Defaults that leave the choice to fabric (and to `fabric run`): 1 process on a CPU, every GPU on a GPU machine.
    parser.add_argument("--accelerator", default="auto", help="cpu, cuda, gpu, mps or auto")
    parser.add_argument("--strategy", default="auto", help="e.g. ddp, ddp_spawn; auto: ddp for several devices")
    parser.add_argument("--devices", default="auto", help="how many devices (processes on a CPU)")
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed, 16-mixed; default: 32-true")
    parser.add_argument("--epochs", type=int, default=3, help="train until this many epochs are done in total")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-3)
    parser.add_argument("--train-size", type=int, default=2048)
    parser.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    parser.add_argument("--resume", type=Path, default=None, help="a checkpoint written by this script")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    fabric = Fabric(
        accelerator=args.accelerator, strategy=args.strategy, devices=args.devices, precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(42)

    model = make_model()
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=args.lr))
    train_loader, val_loader = fabric.setup_dataloaders(
        DataLoader(make_images(args.train_size, seed=1), batch_size=args.batch_size, shuffle=True),
        DataLoader(make_images(512, seed=2), batch_size=256),
    )

    # Plain values ride along with the model and optimizer; fabric.load restores all of them in place.
    state = {"model": model, "optimizer": optimizer, "epoch": -1}
    if args.resume is not None:
        fabric.load(args.resume, state)
        accuracy = evaluate(fabric, model, val_loader)
        fabric.print(f"resumed from {args.resume} after epoch {state['epoch']}: val acc {accuracy:.4f}")

    for epoch in range(state["epoch"] + 1, args.epochs):
        loss = train_epoch(fabric, model, optimizer, train_loader)
        accuracy = evaluate(fabric, model, val_loader)
        fabric.print(f"epoch {epoch}: train loss {loss:.4f}, val acc {accuracy:.4f}")
        state["epoch"] = epoch
        fabric.save(args.checkpoint_dir / "last.ckpt", state)
    fabric.print(f"checkpoint: {args.checkpoint_dir / 'last.ckpt'}")


if __name__ == "__main__":
    main()
