"""A Lightning Fabric script ported with one sed command: throughput and FLOPs logging, rank-zero helpers, resume.

This file was written as Lightning Fabric code and ported with the sed one-liner of the docs page
"Coming from Lightning Fabric", which only renames the package in the imports. Nothing else changed: it
uses `fabric.utilities` (ThroughputMonitor, measure_flops, rank_zero_only, AttributeDict, ...),
`fabric.plugins` and `fabric.loggers` exactly as the original used Lightning's.

Run:  python examples/lightning_port.py                                  # one process
      python examples/lightning_port.py --accelerator cpu --devices 2    # 2 CPU processes
      python examples/lightning_port.py --resume lightning_port/last.ckpt --max-steps 120
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric, seed_everything
from fabric.loggers import CSVLogger
from fabric.plugins import TorchCheckpointIO
from fabric.utilities import (
    AttributeDict,
    ThroughputMonitor,
    measure_flops,
    rank_zero_only,
    suggested_max_num_workers,
)
from fabric.utilities.rank_zero import rank_zero_info

FEATURES, CLASSES, BATCH_SIZE = 32, 4, 64


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(FEATURES, 128), nn.ReLU(), nn.Linear(128, CLASSES))


def make_data(n: int = 4096) -> TensorDataset:
    """Separable synthetic data, the same in every process."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, FEATURES, generator=generator)
    w = torch.randn(FEATURES, CLASSES, generator=generator)
    return TensorDataset(x, (x @ w).argmax(dim=1))


def flops_per_batch() -> int:
    """Forward and backward FLOPs of one batch, counted on the meta device (nothing is computed)."""
    with torch.device("meta"):
        model = make_model()
        x = torch.randn(BATCH_SIZE, FEATURES)
    return measure_flops(model, lambda: model(x), lambda out: out.sum())


@rank_zero_only
def report(step: int, loss: float, metrics: dict[str, float]) -> None:
    speed = metrics.get("device/samples_per_sec")
    speed_text = "warming up" if speed is None else f"{speed:.0f} samples/s"
    print(f"step {step}: loss {loss:.4f}, {speed_text}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--accelerator", default="auto")
    parser.add_argument("--strategy", default="auto")
    parser.add_argument("--devices", default="1")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--out-dir", default="lightning_port")
    parser.add_argument("--resume", default=None, help="a checkpoint written by an earlier run")
    args = parser.parse_args()

    fabric = Fabric(
        accelerator=args.accelerator,
        strategy=args.strategy,
        devices=args.devices,
        precision=args.precision,
        plugins=[TorchCheckpointIO()],
        loggers=CSVLogger(args.out_dir, name="metrics"),
    )
    fabric.launch()
    seed_everything(42)

    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = fabric.setup(model, optimizer)
    workers = suggested_max_num_workers(fabric.world_size)
    rank_zero_info(f"suggested_max_num_workers: {workers} (this example generates its data in memory and uses 0)")
    loader = fabric.setup_dataloaders(DataLoader(make_data(), batch_size=BATCH_SIZE, shuffle=True))

    state = AttributeDict(model=model, optimizer=optimizer, step=0)
    if args.resume:
        fabric.load(args.resume, state)
        fabric.print(f"resumed at step {state.step}")

    monitor = ThroughputMonitor(fabric, window_size=5)
    flops = flops_per_batch()
    start = time.perf_counter()
    batches = 0
    while state.step < args.max_steps:
        for x, y in loader:
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            fabric.backward(loss)
            optimizer.step()
            state.step += 1
            batches += 1
            monitor.update(time=time.perf_counter() - start, batches=batches, samples=batches * len(x), flops=flops)
            if state.step % args.log_every == 0:
                metrics = monitor.compute_and_log(step=state.step)
                fabric.log("train/loss", loss.item(), step=state.step)
                report(state.step, loss.item(), metrics)
            if state.step >= args.max_steps:
                break

    checkpoint = Path(args.out_dir) / "last.ckpt"
    fabric.save(checkpoint, state)
    fabric.print(f"saved step {state.step} to {checkpoint} (flops per batch: {flops})")
    fabric.logger.finalize("success")


if __name__ == "__main__":
    main()
