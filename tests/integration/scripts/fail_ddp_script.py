"""`strategy="ddp"` (script re-run): one rank fails after the process group is up.

Usage: python fail_ddp_script.py OUTDIR SCENARIO, SCENARIO one of:
  rank1_blocked  rank 1 raises while rank 0 waits in an all_reduce
  rank1_slow     the same, but rank 1 needs SLOW_TEARDOWN_SECONDS to exit after leaving the process group
                 (a plugin flushing pending work at teardown, e.g. an asynchronous checkpoint upload)
  rank1_busy     rank 1 raises while rank 0 computes (sleeps) outside any collective
  rank0_blocked  rank 0 raises while rank 1 waits in an all_reduce
Every rank writes OUTDIR/rank{N}.pid.json before it blocks or fails.
"""

from __future__ import annotations

import os
import sys
import time

import torch
from _it_common import outdir_from_argv, write_json, write_pid

from fabric import Fabric, TorchCheckpointIO

MESSAGE = "integration-test-failure-7f3a9c: rank {rank} gave up on purpose"
SLOW_TEARDOWN_SECONDS = 4.0


class SlowTeardownIO(TorchCheckpointIO):
    """Checkpoint IO whose teardown takes a while on local rank 1, as if it flushed a pending upload."""

    def teardown(self) -> None:
        if os.environ.get("LOCAL_RANK") == "1":
            time.sleep(SLOW_TEARDOWN_SECONDS)
        super().teardown()


def main() -> None:
    outdir = outdir_from_argv()
    scenario = sys.argv[2]
    failing_rank = 0 if scenario == "rank0_blocked" else 1
    plugins = [SlowTeardownIO()] if scenario == "rank1_slow" else None
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, plugins=plugins)
    fabric.launch()
    rank = fabric.global_rank
    fabric.barrier()  # both ranks are in the process group
    write_pid(outdir, rank)
    if rank == failing_rank:
        time.sleep(0.5)  # let the other rank block first
        write_json(outdir / "failed_at.json", {"time": time.time(), "rank": rank})
        raise RuntimeError(MESSAGE.format(rank=rank))
    if scenario == "rank1_busy":
        time.sleep(45)  # work outside any collective; fabric must end this process long before
    fabric.all_reduce(torch.ones(1), reduce_op="sum")  # never completes: the peer is gone
    write_json(outdir / f"rank{rank}.unexpected.json", {"passed_collective": True})


if __name__ == "__main__":
    main()
