"""The same training loop in raw PyTorch DDP and in fabric (strategy="ddp", devices=2), for parity tests.

Usage: python parity_train.py OUTDIR
One job runs both modes: first raw (2 ranks forked from this process before fabric touches anything, with their own
process group), then fabric (this process calls fabric.launch() and becomes rank 0; the launcher starts rank 1 by
running this script again). Each mode runs every variant in VARIANTS in one process group and writes each rank's
final weights to OUTDIR/{mode}_{variant}_rank{N}.pt (and the weights before training to ..._init_rank{N}.pt).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _it_common import import_before_fork, outdir_from_argv
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

SEED = 1234
EPOCHS = 2
BATCH_SIZE = 16
WORLD_SIZE = 2

# variant -> (optimizer factory, accumulate gradients over 2 micro-batches)
VARIANTS: dict[str, tuple[Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer], bool]] = {
    "sgd": (lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), False),
    "adamw": (lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01), False),
    "sgd_accumulate": (lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9), True),
}


def make_dataset() -> TensorDataset:
    """256 samples, from a generator of its own so that no global seed touches the data."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(256, 16, generator=generator)
    y = (x @ torch.randn(16, 4, generator=generator)).argmax(dim=1)
    return TensorDataset(x, y)


def make_model() -> nn.Module:
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def save(model: nn.Module, outdir: Path, name: str) -> None:
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, outdir / f"{name}.pt")


# -- raw PyTorch ---------------------------------------------------------------------------------------
def raw_worker(rank: int, outdir: Path, port: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=WORLD_SIZE, rank=rank)
    try:
        dataset = make_dataset()
        for variant, (make_optimizer, accumulate) in VARIANTS.items():
            torch.manual_seed(SEED)
            module = make_model()
            save(module, outdir, f"raw_{variant}_init_rank{rank}")
            model = DistributedDataParallel(module)
            optimizer = make_optimizer(model.parameters())
            sampler = DistributedSampler(dataset, num_replicas=WORLD_SIZE, rank=rank, shuffle=True, seed=SEED)
            loader = DataLoader(dataset, batch_size=BATCH_SIZE, sampler=sampler)
            for epoch in range(EPOCHS):
                sampler.set_epoch(epoch)
                for step, (x, y) in enumerate(loader):
                    is_accumulating = accumulate and step % 2 == 0
                    with model.no_sync() if is_accumulating else nullcontext():
                        loss = nn.functional.cross_entropy(model(x), y)
                        loss.backward()
                    if not is_accumulating:
                        optimizer.step()
                        optimizer.zero_grad()
            save(module, outdir, f"raw_{variant}_rank{rank}")
            # A raw DDP model freed after destroy_process_group can hang this process (docs/troubleshooting.md).
            del model, optimizer
    finally:
        dist.destroy_process_group()


def run_raw(outdir: Path) -> None:
    from fabric.environments.default import find_free_port

    import_before_fork()  # this process imports it for its own fabric rank anyway

    mp.start_processes(raw_worker, args=(outdir, find_free_port()), nprocs=WORLD_SIZE, start_method="fork")


# -- fabric --------------------------------------------------------------------------------------------
def run_fabric(outdir: Path) -> None:
    from fabric import Fabric

    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=WORLD_SIZE)
    fabric.launch()
    torch.set_num_threads(1)
    dataset = make_dataset()
    for variant, (make_optimizer, accumulate) in VARIANTS.items():
        fabric.seed_everything(SEED)
        model = make_model()
        save(model, outdir, f"fabric_{variant}_init_rank{fabric.global_rank}")
        optimizer = make_optimizer(model.parameters())
        model, optimizer = fabric.setup(model, optimizer)
        loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=BATCH_SIZE, shuffle=True))
        for _ in range(EPOCHS):
            for step, (x, y) in enumerate(loader):
                is_accumulating = accumulate and step % 2 == 0
                with fabric.no_backward_sync(model, enabled=is_accumulating):
                    loss = nn.functional.cross_entropy(model(x), y)
                    fabric.backward(loss)
                if not is_accumulating:
                    optimizer.step()
                    optimizer.zero_grad()
        save(model, outdir, f"fabric_{variant}_rank{fabric.global_rank}")
    fabric.barrier()


if __name__ == "__main__":
    out = outdir_from_argv()
    if "LOCAL_RANK" not in os.environ:  # the launching process; fabric's rank 1 re-runs this script with LOCAL_RANK
        run_raw(out)
        print(f"parity raw done in pid {os.getpid()}")
    run_fabric(out)
    print(f"parity fabric done in pid {os.getpid()}")
