"""A script that saves with AsyncCheckpointIO and exits at once: the write completes; failures are printed.

Usage: python async_exit.py OUTDIR
1. A Fabric whose background save fails is dropped (garbage-collected) right after the call.
2. A Fabric kept until exit saves to a path that fails, and nothing calls it again.
3. A Fabric local to main() saves ~40 MB, and the script returns at once.
The test checks that OUTDIR/exit.pt is complete and that stderr names both failed paths.
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from _it_common import outdir_from_argv

from fabric import AsyncCheckpointIO, Fabric

KEPT: list[Any] = []


def main() -> None:
    outdir = outdir_from_argv()
    (outdir / "blocker").write_text("a file where a folder should be")
    dropped = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO()])
    dropped.save(outdir / "blocker" / "dropped.pt", {"x": 1})
    del dropped
    gc.collect()
    kept = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO()])
    kept.save(outdir / "blocker" / "kept.pt", {"x": 2})
    KEPT.append(kept)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO()])
    state = {"weights": torch.arange(10_000_000, dtype=torch.float32), "step": 42}
    fabric.save(outdir / "exit.pt", state)
    print("save returned", flush=True)


if __name__ == "__main__":
    main()
