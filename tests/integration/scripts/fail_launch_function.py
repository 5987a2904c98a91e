"""`ddp_spawn` / `ddp_fork`: rank 1 fails inside the function given to `fabric.launch`.

Usage: python fail_launch_function.py OUTDIR STRATEGY SCENARIO, SCENARIO one of:
  raise_busy     rank 1 raises while rank 0 computes (sleeps) outside any collective
  raise_slow     rank 1 raises while rank 0 waits in an all_reduce, and rank 1 needs SLOW_TEARDOWN_SECONDS to
                 exit after leaving the process group (a plugin flushing pending work at teardown)
  exit3          rank 1 calls os._exit(3) while rank 0 waits in an all_reduce
  sigkill        rank 1 is killed by SIGKILL while rank 0 waits in an all_reduce
Writes OUTDIR/result.json with what `fabric.launch` raised (type and message) and when it returned.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _it_common import outdir_from_argv, write_json, write_pid

from fabric import Fabric, TorchCheckpointIO

MESSAGE = "integration-test-failure-c41e: rank 1 raised on purpose"
SLOW_TEARDOWN_SECONDS = 4.0


class SlowTeardownIO(TorchCheckpointIO):
    """Checkpoint IO whose teardown takes a while on local rank 1, as if it flushed a pending upload."""

    def teardown(self) -> None:
        if os.environ.get("LOCAL_RANK") == "1":
            time.sleep(SLOW_TEARDOWN_SECONDS)
        super().teardown()


def work(fabric: Fabric, outdir: Path, scenario: str) -> dict[str, Any]:
    rank = fabric.global_rank
    fabric.barrier()  # both ranks are in the process group
    write_pid(outdir, rank)
    if rank == 1:
        time.sleep(0.5)  # let rank 0 block first
        write_json(outdir / "failed_at.json", {"time": time.time(), "rank": rank})
        if scenario in ("raise_busy", "raise_slow"):
            raise ValueError(MESSAGE)
        if scenario == "exit3":
            os._exit(3)
        if scenario == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise SystemExit(f"unknown scenario {scenario!r}")
    if scenario == "raise_busy":
        time.sleep(45)  # work outside any collective; fabric must end this process long before
    fabric.all_reduce(torch.ones(1), reduce_op="sum")  # never completes: the peer is gone
    return {"unexpected": "rank 0 passed the collective"}


def main() -> None:
    outdir = outdir_from_argv()
    strategy, scenario = sys.argv[2], sys.argv[3]
    plugins = [SlowTeardownIO()] if scenario == "raise_slow" else None
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2, plugins=plugins)
    try:
        result = fabric.launch(work, outdir, scenario)
    except Exception as err:
        report = {"raised": type(err).__name__, "message": str(err)}
    else:
        report = {"raised": None, "result": repr(result)}
    write_json(outdir / "result.json", {**report, "returned_at": time.time()})


if __name__ == "__main__":
    main()
