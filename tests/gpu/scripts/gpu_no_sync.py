"""One GPU: fabric's default collectives and training steps wait for the GPU no more often than raw torch does.

Usage: python gpu_no_sync.py OUTDIR
Writes OUTDIR/rank0.pt: for each case, the number of synchronizing CUDA calls that torch reported under
`torch.cuda.set_sync_debug_mode("warn")` for the raw torch call and for fabric's. A one-process NCCL group
(`strategy="ddp", devices=1`) stands in for many GPUs: the Python each call runs is the same. The first
measured case is `Tensor.item()`, which must count 1, so a counter that sees nothing fails the test.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import _gpu_paths  # noqa: F401  (puts tests/integration/scripts on the path)
import torch
import torch.distributed as dist
from _it_common import outdir_from_argv
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fabric import Fabric

MARK = "called a synchronizing CUDA operation"


def count_syncs(action: Callable[[], Any]) -> int:
    """How many synchronizing CUDA calls `action` made, as torch's sync debug mode reports them."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            action()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum(MARK in str(w.message) for w in caught)


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)


def step_function(model: Any, optimizer: Any, backward: Callable[[Any], None], device: torch.device) -> Callable:
    x, y = torch.randn(16, 32, device=device), torch.randint(0, 10, (16,), device=device)

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        backward(loss)
        optimizer.step()

    return step


def raw_mean(t: torch.Tensor) -> torch.Tensor:
    summed = t.clone()
    dist.all_reduce(summed)
    return summed.div_(dist.get_world_size())


def setup_step(fabric: Fabric, device: torch.device) -> Callable[[], None]:
    model = _model(device)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return step_function(model, optimizer, fabric.backward, device)


def raw_step(model: nn.Module, device: torch.device) -> Callable[[], None]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return step_function(model, optimizer, lambda loss: loss.backward(), device)


def steady_syncs(step: Callable[[], None]) -> int:
    """Syncs of 3 steps after 3 warm-up steps (DDP rebuilds its buckets in the first ones)."""
    for _ in range(3):
        step()
    return count_syncs(lambda: [step() for _ in range(3)])


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cuda", strategy="ddp", devices=1)
    fabric.launch()
    device = fabric.device
    t = torch.ones(8, device=device)
    results: dict[str, Any] = {"backend": dist.get_backend(), "item": count_syncs(lambda: t.sum().item())}
    for name, case in cases(fabric, device).items():
        try:
            results[name] = case()
        except Exception as error:  # the other cases still run: one GPU run tells all that is wrong
            results[name] = f"error: {error!r}"
    torch.save(results, outdir / "rank0.pt")
    print(results)
    dist.destroy_process_group()


def cases(fabric: Fabric, device: torch.device) -> dict[str, Callable[[], Any]]:
    """Each case returns (raw torch's syncs, fabric's syncs)."""
    t = torch.arange(1024, dtype=torch.float32, device=device)
    out = torch.empty_like(t)

    fabric.all_gather(t), fabric.all_reduce(t.clone(), reduce_op="sum")  # warm-up: NCCL's first calls set up
    single = Fabric(accelerator="cuda", devices=1)  # the common one-GPU script: SingleDeviceStrategy
    return {
        "all_gather": lambda: (
            count_syncs(lambda: dist.all_gather_into_tensor(out, t)),
            count_syncs(lambda: fabric.all_gather(t)),
        ),
        "all_reduce sum": lambda: (
            count_syncs(lambda: dist.all_reduce(t.clone())),
            count_syncs(lambda: fabric.all_reduce(t.clone(), reduce_op="sum")),
        ),
        "all_reduce mean": lambda: (
            count_syncs(lambda: raw_mean(t)),
            count_syncs(lambda: fabric.all_reduce(t.clone(), reduce_op="mean")),
        ),
        "ddp step": lambda: (
            steady_syncs(raw_step(DistributedDataParallel(_model(device), device_ids=[device.index]), device)),
            steady_syncs(setup_step(fabric, device)),
        ),
        "single-device step": lambda: (
            steady_syncs(raw_step(_model(device), device)),
            steady_syncs(setup_step(single, device)),
        ),
    }


if __name__ == "__main__":
    main()
