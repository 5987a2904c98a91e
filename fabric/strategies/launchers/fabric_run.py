"""`fabric run`'s own process: torch's elastic agent (torchrun) runs in it, with three changes.

The workers die with it (see _run_worker); a preemption signal is passed on to the workers instead of ending
them, so they can save and exit 0; and a failure names the rank that failed first, from records the ranks write,
instead of torchrun's guess (it stamps failures in whole seconds as it notices them, so a rank that failed
because a peer had left often came first).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from fabric.strategies.launchers._process import (
    FAILURE_DIR_ENV,
    FailureRecord,
    describe_exit,
    read_failure_records,
    read_finished,
)
from fabric.strategies.launchers._run_worker import MODULE as WORKER_MODULE
from fabric.strategies.launchers._run_worker import PARENT_PID_ENV
from fabric.utilities import _signals

# torchrun's --rdzv_backend for one machine: its static rendezvous, serving the store on loopback only.
LOOPBACK_RENDEZVOUS = "fabric-loopback"


def run_agent(torchrun_argv: list[str]) -> int:
    """Run torchrun with `torchrun_argv` (options, then SCRIPT and its arguments); the exit status for the shell."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from fabric.strategies.launchers import _loopback_rendezvous

    _loopback_rendezvous.register(LOOPBACK_RENDEZVOUS)
    failure_dir = tempfile.mkdtemp(prefix="fabric-run-failures-")
    os.environ[FAILURE_DIR_ENV] = failure_dir
    os.environ[PARENT_PID_ENV] = str(os.getpid())
    forwarded: list[tuple[signal.Signals, float]] = []
    try:
        with _stoppable_without_workers(failure_dir), _forwarding(_signals.preemption_signals(), forwarded):
            run(parse_args(torchrun_argv))
    except ChildFailedError as err:
        records = read_failure_records(failure_dir)
        ended = _ended_by_forwarded_signal(err.failures, records, forwarded)
        if ended is not None:
            print(ended[1], file=sys.stderr)
            return 128 + ended[0]
        # Not torchrun's report: its "root cause" is whichever failure it noticed first, often the wrong rank.
        first = _first_failure(err.failures, records, read_finished(failure_dir))
        print(f"fabric run: a process failed.\n{first}", file=sys.stderr)
        return 1
    except SignalException as err:
        # torchrun has already stopped the workers; exit like a process killed by that signal would.
        return 128 + int(err.sigval)
    except KeyboardInterrupt:  # Ctrl-C while no worker runs (torchrun's own handler covers the workers' time)
        return 128 + signal.SIGINT
    except Exception as err:  # rendezvous timeouts and similar: one line instead of torch's traceback
        print(f"fabric run: torch.distributed.run failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    finally:
        shutil.rmtree(failure_dir, ignore_errors=True)
    return 0


def worker_command(script: str, script_args: list[str]) -> list[str]:
    """The tail of torchrun's command line that starts SCRIPT through the worker entry."""
    return ["--module", WORKER_MODULE, script, *script_args]


def _first_failure(
    failures: dict[int, Any], records: dict[int, FailureRecord], finished: frozenset[int] | set[int] = frozenset()
) -> str:
    """One line naming the rank that failed first, saying only what is known of how.

    `failures`: torchrun's, by global rank; `records`: the ones the ranks wrote as they raised; `finished`: pids
    of ranks whose script had run to its end. A rank that failed first can be missing from `failures`: when a
    peer that failed after it exited sooner, torchrun stopped it (SIGTERM) while it was still exiting. Its
    record still counts. Without records, a rank killed by a signal other than SIGTERM (torchrun's own, to stop
    the others) is named first, then one that exited with an error.
    """
    if records:
        first = min(records.values())
        rank, pid = first.global_rank, first.pid
    else:
        rank = min(failures, key=lambda r: (_stop_signal_order(failures[r].exitcode), r))
        pid = failures[rank].pid
    failure = failures.get(rank)
    recorded = any(record.global_rank == rank for record in records.values())
    if failure is None or _stopped_by_torchrun(failure, records):
        how = "raised an exception; its error is above"
    else:
        how = describe_exit(failure.exitcode, recorded, pid in finished)
        how = how.replace("its traceback is above", "its error is above")
    failed = {r.global_rank for r in records.values()} | {
        r for r, f in failures.items() if f.exitcode != -signal.SIGTERM
    }
    stopped = sorted(set(failures) - failed - {rank})  # torchrun ends the other workers with SIGTERM
    after = f" Rank(s) {', '.join(map(str, sorted(failed - {rank})))} failed after it." if failed - {rank} else ""
    after += f" Rank(s) {', '.join(map(str, stopped))} were stopped by torchrun (SIGTERM)." if stopped else ""
    return f"fabric run: global rank {rank} failed first: it {_with_pid(how, pid)}.{after}"


def _stop_signal_order(exitcode: int) -> int:
    """0 for a death by a signal torchrun does not send to stop workers, 1 for an error exit, 2 for SIGTERM."""
    if exitcode == -signal.SIGTERM:
        return 2
    return 0 if exitcode < 0 else 1


def _with_pid(how: str, pid: int) -> str:
    """`how` with "(pid N)" after its first clause: "exited with code 1 (pid 7); its error is above"."""
    head, sep, tail = how.partition(";")
    return f"{head} (pid {pid}){sep}{tail}"


def _stopped_by_torchrun(failure: Any, records: dict[int, FailureRecord]) -> bool:
    """A rank that recorded an exception but was then stopped by torchrun's signal (its exit code says SIGTERM)."""
    return failure.exitcode == -signal.SIGTERM and failure.local_rank in records


def _ended_by_forwarded_signal(
    failures: dict[int, Any], records: dict[int, FailureRecord], forwarded: list[tuple[signal.Signals, float]]
) -> tuple[int, str] | None:
    """(N, message) when the workers died of signal N that `fabric run` passed on to them, and no rank had failed
    before it (a failure recorded earlier is the job's real failure, reported as such)."""
    if not forwarded:
        return None
    signum, at = forwarded[0]
    ended = sorted(rank for rank, failure in failures.items() if failure.exitcode == -signum)
    if not ended or any(record.time < at for record in records.values()):
        return None
    others = sorted(set(failures) - set(ended))
    after = f" Rank(s) {', '.join(map(str, others))} failed after it." if others else ""
    return signum, (
        f"fabric run: stopped by {signum.name}. It was passed on to the workers, and it ended global rank(s) "
        f"{', '.join(map(str, ended))}: the script does not catch it (a loop that reads fabric.preempted saves "
        f"and exits 0 instead; see docs/preemption.md).{after}"
    )


@contextlib.contextmanager
def _forwarding(signals: tuple[signal.Signals, ...], forwarded: list[tuple[signal.Signals, float]]) -> Iterator[None]:
    """While the workers run, pass these signals on to them and keep waiting, instead of torchrun's stop.

    torchrun sets its handler each time it starts workers (always SIGTERM), and that handler raises to stop
    them; the module-level function it installs is wrapped here so that both torch 2.9 and later versions
    forward. Before any worker exists the signal stops `fabric run` as before. Each forwarded signal is appended
    to `forwarded` with the time it arrived.
    """
    from torch.distributed.elastic.multiprocessing import api

    original: Callable[[int, Any], None] = api._terminate_process_handler

    def handler(signum: int, frame: Any) -> None:
        workers = _children()
        if signum not in signals or not workers:
            original(signum, frame)
            return
        forwarded.append((signal.Signals(signum), time.time()))
        for pid in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    api._terminate_process_handler = handler
    previous = {signum: signal.getsignal(signum) for signum in signals}
    for signum in signals:
        signal.signal(signum, handler)
    try:
        yield
    finally:
        api._terminate_process_handler = original  # type: ignore[assignment]
        for signum, before in previous.items():
            signal.signal(signum, before)


# Signals that end `fabric run` when no worker runs (torchrun's own set, which it stops its workers on).
_ENDING_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


@contextlib.contextmanager
def _stoppable_without_workers(failure_dir: str) -> Iterator[None]:
    """Let SIGTERM, Ctrl-C (and a preemption signal) end `fabric run` at once while none of its workers runs.

    Python runs signal handlers in the main thread between bytecodes, and while it waits at the rendezvous the
    main thread is inside torch's TCPStore connect loop (C++, retried for up to 15 minutes), so the handlers never
    ran and only SIGKILL ended it. The interpreter's C-level handler still writes each signal's number to the
    wakeup fd at once; a thread reading it ends the process with 128 + N when no worker exists. With workers, the
    main thread's handlers decide (it waits in Python then), so nothing here changes that.
    """
    if not Path("/proc/self").is_dir():  # no way to tell whether workers run: leave signals as they are
        yield
        return
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    ending = _ENDING_SIGNALS | set(_signals.preemption_signals())
    thread = threading.Thread(
        target=_end_on_signal_without_workers, args=(read_fd, ending, failure_dir), name="fabric-run-signals",
        daemon=True,
    )  # fmt: skip
    thread.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous)
        os.close(write_fd)  # the thread's read returns b"" and it ends
        thread.join()
        os.close(read_fd)


def _end_on_signal_without_workers(read_fd: int, ending: frozenset[int] | set[int], failure_dir: str) -> None:
    while data := os.read(read_fd, 64):
        for signum in data:
            if signum in ending and not _children():
                name = signal.Signals(signum).name
                where = "waiting for the other machines at the rendezvous, or for them to finish"
                print(f"fabric run: stopped by {name} while none of its processes was running ({where}).",
                      file=sys.stderr, flush=True)  # fmt: skip
                shutil.rmtree(failure_dir, ignore_errors=True)
                os._exit(128 + signum)


def _children() -> list[int]:
    """The pids of this process's children (the workers), from /proc; empty where /proc is missing."""
    me, pids = os.getpid(), []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == me:
                pids.append(int(stat.parent.name))
    return pids
