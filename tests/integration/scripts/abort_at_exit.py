"""Rank 1 finishes its work, then aborts while its process exits (as torch's teardown sometimes does:
"terminate called without an active exception"); rank 0 ends normally.

Usage: python abort_at_exit.py OUTDIR START, START one of ddp (fabric.launch() re-runs this script), spawn
(fabric.launch(fn) with ddp_spawn), or external (`fabric run` started both processes).
Every rank writes OUTDIR/rank{N}.pid.json; rank 1 writes OUTDIR/rank1.finished.json before it aborts.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import torch
from _it_common import outdir_from_argv, write_json, write_pid

from fabric import Fabric


def work(fabric: Fabric, outdir: Path) -> None:
    fabric.all_reduce(torch.ones(1))
    fabric.barrier()
    write_pid(outdir, fabric.global_rank)
    if fabric.global_rank == 1:
        atexit.register(os.abort)  # runs when the process exits, after the work and the script are done
        write_json(outdir / "rank1.finished.json", {"pid": os.getpid()})


def main() -> None:
    outdir = outdir_from_argv()
    start = sys.argv[2]
    if start == "spawn":
        Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).launch(work, outdir)
        return
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2) if start == "ddp" else Fabric()
    if start == "ddp":
        fabric.launch()
    work(fabric, outdir)


if __name__ == "__main__":
    main()
