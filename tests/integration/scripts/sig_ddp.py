"""`strategy="ddp"` (script re-run) that trains until a signal from the test ends it.

Usage: python sig_ddp.py OUTDIR. Every rank writes OUTDIR/rank{N}.pid.json once the process group is up,
then runs small all_reduces (a training loop's gradient syncs) for at most RUN_SECONDS.
"""

from __future__ import annotations

import time

import torch
from _it_common import outdir_from_argv, write_json, write_pid

from fabric import Fabric

RUN_SECONDS = 40  # far longer than any test waits: the signal, not the loop, must end the job


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2)
    fabric.launch()
    fabric.barrier()
    write_pid(outdir, fabric.global_rank)
    deadline = time.monotonic() + RUN_SECONDS
    while time.monotonic() < deadline:
        fabric.all_reduce(torch.ones(1))
        time.sleep(0.05)
    write_json(outdir / f"rank{fabric.global_rank}.unexpected.json", {"ran_to_the_end": True})


if __name__ == "__main__":
    main()
