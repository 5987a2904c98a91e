"""Helpers shared by the integration scripts (a sibling module they import; pytest never collects it)."""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any


def outdir_from_argv() -> Path:
    """The results folder: the first command-line argument."""
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} OUTDIR [ARGS...]")
    return Path(sys.argv[1])


def free_port() -> int:
    """A TCP port free on the loopback interface now, for a job's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def import_before_fork(*modules: str) -> None:
    """Import torch._dynamo (and MODULES) in the parent, so that ranks forked from it inherit them.

    Each rank's optimizer or DDP wrapper imports torch._dynamo (about 2.7 CPU-s per process); imported once here it
    costs one import for the whole job. Nothing distributed starts here: the group is still the ranks' own.
    """
    for name in ("torch._dynamo", *modules):
        importlib.import_module(name)


def write_json(path: Path, data: Any) -> None:
    """Write atomically, so the test never reads a half-written file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)


def write_pid(outdir: Path, rank: int) -> None:
    """Record this rank's pid, and when it wrote it, before it blocks or fails on purpose."""
    write_json(outdir / f"rank{rank}.pid.json", {"pid": os.getpid(), "rank": rank, "time": time.time()})


def run_checks(checks: Mapping[str, Callable[[Path], Any]], devices: int) -> None:
    """Run every check in one job of `devices` CPU ranks; each rank saves OUTDIR/rank{N}.pt (check name -> what it
    returned, or {"error": traceback}). A check that raises does not stop the next: the barrier after each keeps
    the ranks in step."""
    import torch

    from fabric import Fabric

    outdir = outdir_from_argv()
    base = Fabric(accelerator="cpu", devices=devices, strategy="ddp")
    base.launch()
    results = run_each(checks, lambda check: check(outdir), base.barrier)
    torch.save(results, outdir / f"rank{base.global_rank}.pt")


def run_each(
    checks: Mapping[str, Callable[..., Any]],
    call: Callable[[Callable[..., Any]], Any],
    barrier: Callable[[], Any],
    results: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run every check as `call(check)` into `results` (check name -> what it returned, or {"error": traceback}).

    A check that raises does not stop the next; `barrier` after each keeps the ranks in step. Pass `results` to
    keep what was collected when a barrier itself fails (save it in a `finally`).
    """
    results = {} if results is None else results
    for name, check in checks.items():
        try:
            results[name] = call(check)
        except Exception:
            results[name] = {"error": traceback.format_exc()}
        barrier()
    return results
