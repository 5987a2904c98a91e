"""`ddp_spawn` / `ddp_fork` / `ddp_notebook`: `fabric.launch(fn)` from a script.

Usage: python launch_function.py OUTDIR STRATEGY MODE [ADDRESSES], MODE one of:
  basic  seed_everything(123) runs before launch; each rank writes rank{N}.json (ranks, pid, an all_reduce, its
         first torch.rand draws), then the job probes its store on ADDRESSES (comma-separated, may be empty; see
         store_exposure.py), so that one ddp_spawn job serves both tests of `ddp_spawn`; launch returns rank 0's dict
  big    rank 0 returns a tensor of about 8 MB; a watchdog records a hang after WATCHDOG_SECONDS
The parent writes OUTDIR/parent.json with what launch returned (or raised) and its own pid.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from _it_common import outdir_from_argv, write_json
from store_exposure import parse_addresses, probe

from fabric import Fabric

BIG_NUMEL = 2_000_000
WATCHDOG_SECONDS = 6.0


def basic(fabric: Fabric, outdir: Path, token: str, addresses: list[str]) -> dict[str, Any]:
    draws = torch.rand(4).tolist()  # before any other use of the RNG in this process
    rank = fabric.global_rank
    total = fabric.all_reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
    write_json(
        outdir / f"rank{rank}.json",
        {
            "global_rank": rank,
            "local_rank": fabric.local_rank,
            "node_rank": fabric.node_rank,
            "world_size": fabric.world_size,
            "device": str(fabric.device),
            "is_global_zero": fabric.is_global_zero,
            "all_reduce_sum": total.item(),
            "draws": draws,
            "pid": os.getpid(),
            "ppid": os.getppid(),
        },
    )
    probe(fabric, outdir, addresses)
    return {"rank": rank, "token": token, "sum": total, "pid": os.getpid()}


def big(fabric: Fabric, outdir: Path, token: str, addresses: list[str]) -> torch.Tensor:
    fabric.barrier()
    return torch.arange(BIG_NUMEL, dtype=torch.float32) + fabric.global_rank


def _start_watchdog(outdir: Path, report: dict[str, Any]) -> None:
    """If launch does not return in time, say so and end this process (the test kills what is left)."""

    def expire() -> None:
        write_json(outdir / "parent.json", {**report, "hung": True})
        os._exit(3)

    timer = threading.Timer(WATCHDOG_SECONDS, expire)
    timer.daemon = True
    timer.start()


def main() -> None:
    outdir = outdir_from_argv()
    strategy, mode = sys.argv[2], sys.argv[3]
    addresses = parse_addresses(sys.argv[4]) if len(sys.argv) > 4 else []
    Fabric.seed_everything(123)
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    report: dict[str, Any] = {"parent_pid": os.getpid(), "hung": False}
    if mode == "big":
        _start_watchdog(outdir, report)
    start = time.monotonic()
    try:
        result = fabric.launch({"basic": basic, "big": big}[mode], outdir, "token-5d2", addresses)
    except Exception as err:
        report.update(raised=type(err).__name__, message=str(err))
    else:
        report.update(raised=None, result_type=type(result).__name__)
        if isinstance(result, dict):
            report["result"] = {k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in result.items()}
            report["sum_type"] = type(result["sum"]).__name__
        elif isinstance(result, torch.Tensor):
            report["result_is_rank0s"] = torch.equal(result, torch.arange(BIG_NUMEL, dtype=torch.float32))
    report["elapsed"] = time.monotonic() - start
    write_json(outdir / "parent.json", report)


if __name__ == "__main__":
    main()
