"""SIGKILL during background saves: the checkpoint file always loads, complete, as one of the saved versions.

Usage: python async_kill.py OUTDIR ROUNDS
The parent imports torch once, saves version 0, then ROUNDS times forks a child that saves new versions back to
back with AsyncCheckpointIO (so a background write is nearly always in flight) and kills it with SIGKILL after a
random delay. After each kill it loads the file and records what it found in OUTDIR/result.json.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from _it_common import outdir_from_argv, write_json
from torch import nn

from fabric import AsyncCheckpointIO, Fabric

SIZE = 1_000_000  # 4 MB per tensor, 3 tensors: a write takes long enough to be hit


def state_of(version: int) -> dict[str, Any]:
    """Every tensor filled with `version`: a file mixing two saves, or cut short, is detected."""
    layer = nn.Linear(1000, 1000)
    with torch.no_grad():
        layer.weight.fill_(version)
        layer.bias.fill_(version)
    return {"model": layer, "extra": torch.full((SIZE,), float(version)), "version": version}


def child(path: Path, first_version: int, ready: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO()])
    state = state_of(first_version)
    version = first_version
    ready.write_text(str(os.getpid()))
    while True:
        state["version"] = version
        fabric.save(path, state)  # returns after the copy; the previous write finished before it
        version += 1
        with torch.no_grad():
            state["model"].weight.fill_(version)
            state["model"].bias.fill_(version)
            state["extra"].fill_(version)


def check(path: Path, max_version: int) -> dict[str, Any]:
    try:
        loaded = torch.load(path, weights_only=False, map_location="cpu")
    except Exception:
        return {"error": traceback.format_exc()}
    version = loaded["version"]
    consistent = all(
        bool((tensor == version).all())
        for tensor in (loaded["model"]["weight"], loaded["model"]["bias"], loaded["extra"])
    )
    return {"version": version, "consistent": consistent, "in_range": 0 <= version <= max_version}


def main() -> None:
    outdir = outdir_from_argv()
    rounds = int(sys.argv[2])
    torch.set_num_threads(1)
    path = outdir / "ckpt.pt"
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[AsyncCheckpointIO()])
    fabric.save(path, state_of(0))
    fabric.barrier()  # version 0 is complete; no thread runs in this process when it forks
    rng = random.Random(1234)
    results = []
    next_version = 1
    for _ in range(rounds):
        ready = outdir / "ready"
        ready.unlink(missing_ok=True)
        pid = os.fork()
        if pid == 0:
            try:
                child(path, next_version, ready)
            finally:
                os._exit(1)
        while not ready.exists():
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.25))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        temp_files = [p.name for p in outdir.iterdir() if p.name.startswith(".ckpt.pt.")]
        result = check(path, next_version + 10_000)
        result["mid_write"] = bool(temp_files)
        results.append(result)
        for name in temp_files:  # what a killed write leaves; the next saves must not depend on it
            (outdir / name).unlink(missing_ok=True)
        next_version += 10_000
    write_json(outdir / "result.json", results)


if __name__ == "__main__":
    main()
