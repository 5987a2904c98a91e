"""Gradient accumulation: several micro-batches per optimizer step, with the gradient all-reduce only on the last.

`fabric.no_backward_sync(model, enabled=not is_last)` skips DDP's gradient synchronisation for the micro-batches
before the last one of each step: their gradients only add up locally, and the last backward all-reduces the
sum once. That saves (accumulate - 1) all-reduces per step and gives the same update as one big batch.

Run:  python examples/gradient_accumulation.py --accelerator cpu --devices 2 --accumulate 4
      python examples/gradient_accumulation.py --accelerator cuda --devices 2 --precision bf16-mixed
"""

from __future__ import annotations

import argparse

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric


def make_data(n: int = 4096, features: int = 16) -> TensorDataset:
    """A noisy linear regression problem, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, features, generator=generator)
    w = torch.randn(features, 1, generator=generator)
    return TensorDataset(x, x @ w + 0.1 * torch.randn(n, 1, generator=generator))


def gradients(model: nn.Module) -> Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])


def same_on_all_ranks(fabric: Fabric, tensor: Tensor) -> bool:
    # all_gather stacks the ranks' tensors along a new first dimension, except on one process (as in Lightning).
    gathered = fabric.all_gather(tensor).reshape(fabric.world_size, -1)
    return bool((gathered == gathered[0]).all())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # Defaults that leave the choice to fabric (and to `fabric run`): 1 process on a CPU, every GPU on a GPU machine.
    parser.add_argument("--accelerator", default="auto", help="cpu, cuda, gpu, mps or auto")
    parser.add_argument("--strategy", default="auto", help="e.g. ddp, ddp_spawn; auto: ddp for several devices")
    parser.add_argument("--devices", default="auto", help="how many devices (processes on a CPU)")
    parser.add_argument("--precision", default=None, help="e.g. bf16-mixed, 16-mixed; default: 32-true")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--accumulate", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-2)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    fabric = Fabric(
        accelerator=args.accelerator, strategy=args.strategy, devices=args.devices, precision=args.precision
    )
    fabric.launch()
    fabric.seed_everything(42)

    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=args.micro_batch_size, shuffle=True))
    batch = args.micro_batch_size * args.accumulate * fabric.world_size
    fabric.print(f"effective batch size {batch} = {args.micro_batch_size} x {args.accumulate} x {fabric.world_size}")

    steps = 0
    for epoch in range(args.epochs):
        total = torch.zeros((), device=fabric.device)
        for i, (x, y) in enumerate(loader):
            # The last micro-batch of a step, or of the epoch (so no gradient is carried into the next epoch).
            is_last = (i + 1) % args.accumulate == 0 or i + 1 == len(loader)
            with fabric.no_backward_sync(model, enabled=not is_last):
                loss = nn.functional.mse_loss(model(x), y)
                # Divide so the accumulated gradient is the mean over the micro-batches, like one big batch.
                fabric.backward(loss / args.accumulate)
            total += loss.detach()
            if steps == 0 and fabric.world_size > 1:
                # Once, to show what no_backward_sync does: each rank's gradient is its own until the last
                # micro-batch's backward averages the sum across ranks.
                synced = same_on_all_ranks(fabric, gradients(model))
                fabric.print(f"micro-batch {i} of the first step: gradients equal on all ranks: {synced}")
            if is_last:
                optimizer.step()
                optimizer.zero_grad()
                steps += 1
        mean_loss = fabric.all_reduce(total / len(loader), reduce_op="mean")
        fabric.print(f"epoch {epoch}: loss {mean_loss.item():.4f} ({steps} optimizer steps so far)")

    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    fabric.print(f"weights equal on all {fabric.world_size} ranks: {same_on_all_ranks(fabric, weights)}")


if __name__ == "__main__":
    main()
