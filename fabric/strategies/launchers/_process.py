"""What every launcher does to a process it starts: tie its life to the launcher's, and record when it failed."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

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


class FailureRecord(NamedTuple):
    """What a failing rank wrote about itself: when it failed, its global rank and its pid."""

    time: float
    global_rank: int
    pid: int


def read_failure_records(directory: str | None) -> dict[int, FailureRecord]:
    """Local rank -> its failure record, from the records the ranks wrote."""
    if directory is None:
        return {}
    records = {}
    for path in Path(directory).glob("rank*.failed"):
        with contextlib.suppress(OSError, ValueError, TypeError):
            moment, global_rank, pid = path.read_text().split()
            records[int(path.stem[4:])] = FailureRecord(float(moment), int(global_rank), int(pid))
    return records


def record_finished() -> None:
    """In a rank started by a fabric launcher: its script has run to its end (returned or called sys.exit).

    What comes after (atexit hooks, interpreter teardown, where torch can abort a rank) then reads as "while
    exiting" in the launcher's summary, instead of being taken for an error the rank printed.
    """
    directory = os.environ.get(FAILURE_DIR_ENV)
    if directory is not None:
        with contextlib.suppress(OSError):
            (Path(directory) / f"pid{os.getpid()}.finished").touch()


def read_finished(directory: str | None) -> set[int]:
    """The pids of the ranks whose script ran to its end."""
    if directory is None:
        return set()
    pids = set()
    for path in Path(directory).glob("pid*.finished"):
        with contextlib.suppress(ValueError):
            pids.add(int(path.stem[3:]))
    return pids


def describe_exit(code: int, recorded: bool, finished: bool) -> str:
    """How a rank ended, saying only what is known: e.g. "was killed by SIGABRT while exiting, after
    its script had finished; it recorded no Python error"."""
    if code < 0:
        how, after = f"was killed by {_signal_text(-code)}", " while exiting, after its script had finished"
    else:
        how, after = f"exited with code {code}", " after its script had finished"
    how += after if finished else ""
    return f"{how}; its traceback is above" if recorded else f"{how}; it recorded no Python error"


def _signal_text(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def read_failures(directory: str | None) -> dict[int, float]:
    """Local rank -> time of failure, from the records the ranks wrote."""
    return {rank: record.time for rank, record in read_failure_records(directory).items()}


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
            tmp.write_text(f"{time.time()!r} {global_rank} {os.getpid()}")
            tmp.replace(record)  # the launcher never reads a half-written time
        print(f"[fabric] Global rank {global_rank} failed:", file=sys.stderr, flush=True)
        previous(*exc_info)

    sys.excepthook = hook
