"""Collectives, data sharding, rank_zero_first and checkpoints on 2 CPU ranks (`strategy="ddp"`).

Usage: python collectives_checkpoint.py OUTDIR
Each rank writes OUTDIR/rank{N}.pt: a dict from check name to what this rank observed (or {"error": traceback}).
The test process asserts on them.
"""

from __future__ import annotations

import hashlib
import os
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _it_common import outdir_from_argv
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric

SEED = 7


def gather_tensor(fabric: Fabric, outdir: Path) -> Any:
    return fabric.all_gather(torch.arange(3.0) + 10 * fabric.global_rank)


def gather_number(fabric: Fabric, outdir: Path) -> Any:
    return fabric.all_gather(10 * fabric.global_rank + 1)


def gather_nested(fabric: Fabric, outdir: Path) -> Any:
    rank = fabric.global_rank
    data = {"t": torch.tensor([rank, -rank]), "inner": {"n": rank + 1, "s": torch.tensor(rank + 0.5)}}
    return fabric.all_gather(data)


def gather_sync_grads(fabric: Fabric, outdir: Path) -> Any:
    rank = fabric.global_rank
    x = torch.tensor([rank + 1.0], requires_grad=True)
    gathered = fabric.all_gather(x, sync_grads=True)  # (2, 1)
    # Each rank weighs rank j's entry by (j + 1) and scales its loss by (rank + 1), so the gradient reaching
    # rank j sums over both losses: (j + 1) * (1 + 2).
    loss = (gathered.squeeze(1) * torch.tensor([1.0, 2.0])).sum() * (rank + 1)
    loss.backward()
    plain = fabric.all_gather(torch.tensor([rank + 1.0], requires_grad=True))
    return {
        "gathered": gathered.detach(),
        "requires_grad": gathered.requires_grad,
        "grad": x.grad,
        "plain_requires_grad": plain.requires_grad,
    }


def all_reduce(fabric: Fabric, outdir: Path) -> Any:
    rank = fabric.global_rank
    results: dict[str, Any] = {}
    for dtype in (torch.float32, torch.int64):
        for op in ("sum", "mean", "max", "min"):
            value = torch.tensor([rank + 1, 10 * (rank + 1)], dtype=dtype)
            before = value.clone()
            results[f"{op}_{dtype}"] = fabric.all_reduce(value, reduce_op=op)
            results[f"{op}_{dtype}_input_unchanged"] = torch.equal(value, before)
    results["nested_sum"] = fabric.all_reduce({"a": rank + 1, "b": torch.tensor([2.0 * rank])}, reduce_op="sum")
    return results


def broadcast(fabric: Fabric, outdir: Path) -> Any:
    rank = fabric.global_rank
    obj = {"sender": rank, "payload": [rank, {"nested": f"from-{rank}"}], "tensor": torch.full((2,), rank)}
    return {"src1": fabric.broadcast(obj, src=1), "src0": fabric.broadcast(f"hello from {rank}")}


def barrier(fabric: Fabric, outdir: Path) -> Any:
    marker = outdir / "barrier_marker.txt"
    start = time.monotonic()
    if fabric.global_rank == 1:
        time.sleep(1.0)
        marker.write_text("rank 1 reached the barrier")
    fabric.barrier()
    return {"marker_seen_after_barrier": marker.exists(), "waited": time.monotonic() - start}


def rank_zero_first(fabric: Fabric, outdir: Path) -> Any:
    prepared = outdir / "prepared.txt"
    with fabric.rank_zero_first():
        existed_on_entry = prepared.exists()
        if fabric.global_rank == 0:
            time.sleep(0.5)  # a slow download
            prepared.write_text("prepared by rank 0")
        content = prepared.read_text() if prepared.exists() else None
    fabric.barrier()
    return {"existed_on_entry": existed_on_entry, "content": content}


def shards(fabric: Fabric, outdir: Path) -> Any:
    fabric.seed_everything(SEED)
    loader = DataLoader(TensorDataset(torch.arange(64)), batch_size=8, shuffle=True)
    loader = fabric.setup_dataloaders(loader)
    epochs = [[int(i) for (batch,) in loader for i in batch] for _ in range(2)]
    return {"epochs": epochs, "sampler": type(loader.sampler).__name__}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def checkpoint(fabric: Fabric, outdir: Path) -> Any:
    rank = fabric.global_rank
    fabric.seed_everything(SEED)
    model = nn.Linear(4, 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(model(torch.randn(8, 4)).pow(2).mean())
    optimizer.step()  # the optimizer now has momentum buffers

    writes: list[str] = []
    io = fabric.strategy.checkpoint_io
    original_save = io.save_checkpoint

    def counting_save(checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        writes.append(str(path))
        original_save(checkpoint, path, storage_options=storage_options)

    io.save_checkpoint = counting_save  # type: ignore[method-assign]
    folder = outdir / "ckpt"
    path = folder / "state.ckpt"
    fabric.save(path, {"model": model, "optimizer": optimizer, "step": 5})
    listing_after_save = sorted(p.name for p in folder.iterdir())
    saved_model = {k: v.clone() for k, v in model.state_dict().items()}
    saved_momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]

    with torch.no_grad():  # make both ranks' weights and optimizer state wrong, differently
        for param in model.parameters():
            param.fill_(100.0 + rank)
            optimizer.state[param]["momentum_buffer"].fill_(-1.0 - rank)
    state = {"model": model, "optimizer": optimizer, "step": 0}
    remainder = fabric.load(path, state)
    loaded_model = {k: v.clone() for k, v in model.state_dict().items()}
    loaded_momentum = [optimizer.state[p]["momentum_buffer"].clone() for p in model.parameters()]

    # A save that fails (a lambda cannot be pickled) must leave the previous checkpoint as it was.
    digest_before = _sha256(path)
    try:
        fabric.save(path, {"model": model, "extra": {"nested": {"fn": lambda x: x}}})
        failed_save_error = None
    except Exception as err:
        failed_save_error = f"{type(err).__name__}: {err}"
        # Only rank 0 writes, so only rank 0 raises; the other ranks wait in save's barrier.
        fabric.barrier()
    listing_after_failed_save = sorted(p.name for p in folder.iterdir())
    state_after_failure = {"model": nn.Linear(4, 3), "step": None}
    fabric.load(path, state_after_failure, strict=False)
    return {
        "writes": writes,
        "listing_after_save": listing_after_save,
        "saved_model": saved_model,
        "saved_momentum": saved_momentum,
        "loaded_model": loaded_model,
        "loaded_momentum": loaded_momentum,
        "loaded_step": state["step"],
        "remainder": sorted(remainder),
        "failed_save_error": failed_save_error,
        "digest_unchanged": digest_before == _sha256(path),
        "listing_after_failed_save": listing_after_failed_save,
        "model_after_failed_save": state_after_failure["model"].state_dict(),
        "step_after_failed_save": state_after_failure["step"],
    }


CHECKS: list[Callable[[Fabric, Path], Any]] = [
    gather_tensor,
    gather_number,
    gather_nested,
    gather_sync_grads,
    all_reduce,
    broadcast,
    barrier,
    rank_zero_first,
    shards,
    checkpoint,
]


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    results: dict[str, Any] = {"pid": os.getpid()}
    for check in CHECKS:
        try:
            results[check.__name__] = check(fabric, outdir)
        except Exception:
            results[check.__name__] = {"error": traceback.format_exc()}
        fabric.barrier()
    torch.save(results, outdir / f"rank{fabric.global_rank}.pt")


if __name__ == "__main__":
    main()
