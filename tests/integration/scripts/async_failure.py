"""Background saves that fail on rank 0 only, on 2 gloo ranks: every rank raises the same error, promptly.

Usage: python async_failure.py OUTDIR
The parent forks the two ranks (process group timeout 60 s). Each rank writes OUTDIR/rank{N}.pt: a dict from check
name to observations, or {"error": traceback}. Checks:
1. ddp_barrier: rank 0's background torch.save fails (a lambda cannot be pickled); the next fabric.barrier()
   raises on both ranks.
2. ddp_next_save: the same failure, then the next fabric.save raises on both ranks instead of rank 1 waiting in
   the save's barrier for rank 0.
3. fsdp_publish: an async sharded save whose publish (rank 0 swaps the staging folder into place) fails.
Each time, the checkpoint saved before is intact.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from _it_common import free_port, outdir_from_argv
from torch import nn

from fabric import AsyncCheckpointIO, Fabric
from fabric.checkpoint import files


def _caught(call: Callable[[], Any]) -> str | None:
    try:
        call()
    except RuntimeError as err:
        return str(err)
    return None


def _ddp(outdir: Path, then: str) -> Any:
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, plugins=[AsyncCheckpointIO()])
    fabric.launch()
    path = outdir / f"{then}.pt"
    fabric.save(path, {"version": 1, "w": torch.ones(3)})
    fabric.barrier()
    # Only rank 0 writes: its background torch.save fails; rank 1 has nothing in flight.
    fabric.save(path, {"version": 2, "fn": lambda x: x})
    following = fabric.barrier if then == "barrier" else (lambda: fabric.save(path, {"version": 3}))
    message = _caught(following)
    fabric.barrier()  # raised once: the group is healthy and the next collective passes
    return {"message": message, "version": torch.load(path, weights_only=False)["version"]}


def ddp_barrier(outdir: Path) -> Any:
    return _ddp(outdir, "barrier")


def ddp_next_save(outdir: Path) -> Any:
    return _ddp(outdir, "save")


def fsdp_publish(outdir: Path) -> Any:
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2, plugins=[AsyncCheckpointIO()])
    fabric.launch()
    torch.manual_seed(0)
    model = fabric.setup_module(nn.Linear(4, 4))
    path = outdir / "sharded"
    fabric.save(path, {"model": model, "version": 1})
    fabric.barrier()
    listing = sorted(p.name for p in path.iterdir())
    swap = files.swap_into_place
    if fabric.global_rank == 0:

        def failing_swap(target: Path) -> None:
            raise OSError(f"cannot publish {target} (injected)")

        files.swap_into_place = failing_swap  # type: ignore[assignment]
    try:
        fabric.save(path, {"model": model, "version": 2})
        message = _caught(fabric.barrier)
    finally:
        files.swap_into_place = swap  # type: ignore[assignment]
    state: dict[str, Any] = {"model": model, "version": 0}
    fabric.load(path, state)
    return {
        "message": message,
        "version": state["version"],
        "unchanged": sorted(p.name for p in path.iterdir()) == listing,
    }


CHECKS: list[Callable[[Path], Any]] = [ddp_barrier, ddp_next_save, fsdp_publish]


def rank_main(rank: int, outdir: Path, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2")  # fmt: skip
    # A short timeout: a rank left waiting for a peer fails within it, with a timeout message the test rejects.
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=60))
    results: dict[str, Any] = {}
    for check in CHECKS:
        try:
            results[check.__name__] = check(outdir)
        except Exception:
            results[check.__name__] = {"error": traceback.format_exc()}
        dist.barrier()
    torch.save(results, outdir / f"rank{rank}.pt")
    dist.destroy_process_group()


def main() -> None:
    outdir = outdir_from_argv()
    torch.set_num_threads(1)
    mp.start_processes(rank_main, args=(outdir, free_port()), nprocs=2, start_method="fork")


if __name__ == "__main__":
    main()
