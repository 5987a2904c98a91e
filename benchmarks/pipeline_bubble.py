"""Pipeline bubble: the measured idle fraction of a PipelineStrategy step against the schedule's theoretical one.

The model is an MLP of equal stages (`--layers` Linear+ReLU of width `--width` each); a microbatch has `--rows`
rows. For each schedule and microbatch count m, every rank times:
- step: `fabric.pipeline_step` (forward and backward of all microbatches, with the loss shared), median of
  `--steps` steps after one warm-up;
- busy: what its stages compute in a step, m x (forward + backward of one microbatch through each of its
  stages), each timed alone, without communication (median of 5).
measured bubble = 1 - busy / step, averaged over the ranks; it includes the time spent in send/recv.
theory = (p - 1) / (v m + p - 1) for p pipeline processes with v stages each (GPipe, 1F1B: v = 1; Interleaved1F1B
here: v = 2): the fill and drain of the pipeline when stages cost the same and communication is free.

Run:  python benchmarks/pipeline_bubble.py [--devices 2] [--accelerator cpu|cuda] [--steps 5] [--smoke]
The GPU suite runs it on 2 GPUs: tests/gpu/test_gpu_multi.py::test_pipeline_bubble_on_two_gpus.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from fabric import Fabric
from fabric.strategies import PipelineStrategy

SCHEDULES = (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2))  # (name, stages per process)


def make_model(stages: int, layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(stages * layers)])


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def busy_time(stages: list[nn.Module], rows: int, width: int, device: torch.device) -> float:
    """One microbatch's forward and backward through each of this rank's stages, timed alone."""
    total = 0.0
    for stage in stages:
        x = torch.randn(rows, width, device=device, requires_grad=True)

        def step(stage: nn.Module = stage, x: torch.Tensor = x) -> None:
            stage(x).sum().backward()

        step()  # warm-up
        total += statistics.median(timed(step, device) for _ in range(5))
        stage.zero_grad()
    return total


def measure(args: argparse.Namespace, name: str, per_rank: int, micro: int) -> tuple[float, float, float] | None:
    """(step ms, busy ms, measured bubble) averaged over the ranks, or None where the schedule refuses m."""
    p = args.devices
    stages = p * per_rank
    split = [str(i * args.layers) for i in range(1, stages)]
    loss_fn = nn.functional.mse_loss
    strategy = PipelineStrategy(split_points=split, schedule=name, microbatches=micro, loss_fn=loss_fn)
    fabric = Fabric(accelerator=args.accelerator, devices=p, strategy=strategy)
    fabric.launch()
    try:
        model = fabric.setup(make_model(stages, args.layers, args.width))
    except ValueError:  # 1F1B needs m >= stages, the interleaved schedules a multiple of p: every rank skips alike
        return None
    x = torch.randn(micro * args.rows, args.width, device=fabric.device)
    steps = []
    for index in range(args.steps + 1):
        fabric.barrier()
        seconds = timed(lambda: fabric.pipeline_step(model, x, target=torch.zeros_like(x)), fabric.device)
        if index:  # the first step also infers the shapes between stages
            steps.append(seconds)
    model.zero_grad()
    local = [stage.module if hasattr(stage, "module") else stage for stage in model._forward_module.stages]
    busy = micro * busy_time(local, args.rows, args.width, fabric.device)
    step = statistics.median(steps)
    numbers = torch.tensor([step, busy, 1 - busy / step], dtype=torch.float64, device=fabric.device)
    step, busy, bubble = fabric.all_reduce(numbers).tolist()
    return step, busy, bubble


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--microbatches", default="1,2,4,8,16")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, 1 step: that it runs, not its numbers")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.microbatches, args.layers, args.width, args.rows = 1, "2,4", 1, 16, 4
    torch.set_num_threads(1)
    base = Fabric(accelerator=args.accelerator, devices=args.devices, strategy="ddp")
    base.launch()
    load = os.getloadavg()[0]  # printed by global rank 0 only
    rows = []
    for name, per_rank in SCHEDULES:
        for micro in (int(m) for m in args.microbatches.split(",")):
            measured = measure(args, name, per_rank, micro)
            if measured is None:
                continue
            step, busy, bubble = measured
            p = args.devices
            theory = (p - 1) / (per_rank * micro + p - 1)
            rows.append((name, p, per_rank, micro, step * 1e3, busy * 1e3, bubble, theory))
    if base.is_global_zero:
        print(f"pipeline bubble, {args.accelerator}, {args.devices} processes; load avg {load:.2f} at start")
        print(f"MLP stages of {args.layers} x Linear({args.width}, {args.width}), microbatches of {args.rows} rows")
        print(f"{'schedule':<16}{'p':>3}{'v':>3}{'m':>4}{'step ms':>10}{'busy ms':>10}{'measured':>10}{'theory':>8}")
        for name, p, v, m, step, busy, bubble, theory in rows:
            print(f"{name:<16}{p:>3}{v:>3}{m:>4}{step:>10.2f}{busy:>10.2f}{bubble:>10.3f}{theory:>8.3f}")


if __name__ == "__main__":
    main()
