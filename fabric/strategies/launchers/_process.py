"""What every launcher does to a process it starts: tie its life to the launcher's, and record when it failed."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

# Launcher-private channel, not a cluster variable: where a rank records that it failed, and when.
FAILURE_DIR_ENV = "FABRIC_LAUNCHER_FAILURE_DIR"


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this process when the process that started it dies, so no rank is left orphaned.

    SIGKILL, not SIGTERM: a rank may catch SIGTERM for graceful preemption, and an orphan must not train on.
    When the parent died before the request took effect (this process already has another parent), exit now.
    """
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def read_failures(directory: str | None) -> dict[int, float]:
    """Local rank -> time of failure, from the records the ranks wrote."""
    if directory is None:
        return {}
    records = {}
    for path in Path(directory).glob("rank*.failed"):
        with contextlib.suppress(OSError, ValueError):
            records[int(path.stem[4:])] = float(path.read_text())
    return records


def report_failures_to_parent(local_rank: int, global_rank: int) -> None:
    """In a rank started by a fabric launcher (or `fabric run`): label a crash with the rank and record it.

    The record is written from the excepthook, before the process leaves the process group, so it
    always precedes the errors the peers get from the group breaking up; the launcher names the rank that
    failed first from these records.
    """
    directory = os.environ.get(FAILURE_DIR_ENV)
    if directory is None:
        return
    previous = sys.excepthook

    def hook(*exc_info: Any) -> None:
        with contextlib.suppress(OSError):
            record = Path(directory) / f"rank{local_rank}.failed"
            tmp = record.with_suffix(".tmp")
            tmp.write_text(repr(time.time()))
            tmp.replace(record)  # the launcher never reads a half-written time
        print(f"[fabric] Global rank {global_rank} failed:", file=sys.stderr, flush=True)
        previous(*exc_info)

    sys.excepthook = hook
