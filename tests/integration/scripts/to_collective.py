"""A rank that never joins a collective: the other rank's collective fails after DDPStrategy(timeout=...).

Usage: python to_collective.py OUTDIR OP [OP ...], OP in barrier, broadcast, all_gather, all_reduce.
Rank 0 runs each OP in turn (3 s timeout) and writes OUTDIR/OP.json with the error and the seconds it waited;
rank 1 never joins, sleeps until rank 0 is done, then exits without a collective.
"""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta

import torch
from _it_common import outdir_from_argv, write_json

from fabric import Fabric
from fabric.strategies import DDPStrategy

TIMEOUT = timedelta(seconds=3)


def main() -> None:
    outdir = outdir_from_argv()
    ops = sys.argv[2:]
    fabric = Fabric(accelerator="cpu", strategy=DDPStrategy(timeout=TIMEOUT), devices=2)
    fabric.launch()
    fabric.barrier()  # both ranks are in the process group
    if fabric.global_rank == 1:
        while not (outdir / "done.json").exists():  # never joins; rank 0's timeouts are what is tested
            time.sleep(0.1)
        os._exit(0)  # the group is broken after a timeout; a clean teardown would only wait again
    calls = {
        "barrier": lambda: fabric.barrier(),
        "broadcast": lambda: fabric.broadcast("x"),
        "all_gather": lambda: fabric.all_gather(torch.ones(1)),
        "all_reduce": lambda: fabric.all_reduce(torch.ones(1)),
    }
    for op in ops:
        start = time.monotonic()
        try:
            calls[op]()
            result = {"raised": None}
        except Exception as err:  # torch's own error, with fabric's explanation added as its last note
            notes = getattr(err, "__notes__", [""])
            result = {"raised": type(err).__name__, "runtime_error": isinstance(err, RuntimeError)}
            result |= {"message": notes[-1], "error": str(err), "cause": repr(err.__cause__)}
        result["seconds"] = time.monotonic() - start
        write_json(outdir / f"{op}.json", result)
    write_json(outdir / "done.json", {})
    time.sleep(0.5)  # let rank 1 see done.json and leave first
    os._exit(0)


if __name__ == "__main__":
    main()
