"""`ddp`: re-run the user's script in new processes for local ranks 1..N-1; this process is rank 0."""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fabric.strategies.launchers import _hydra, _run_worker
from fabric.strategies.launchers._process import FAILURE_DIR_ENV, describe_exit, read_failures, read_finished
from fabric.strategies.launchers._process import report_failures_to_parent as report_failures_to_parent
from fabric.strategies.launchers.launcher import Launcher
from fabric.utilities import _signals

_POLL_SECONDS = 0.1
_TERMINATE_GRACE_SECONDS = 5.0
# How long rank 0, failing, looks for a child whose death caused its error (only delays a failing exit).
_BLAME_WAIT_SECONDS = 1.0


def _script_command() -> list[str]:
    """The command that runs what started this process (through the worker entry), so the children run the same."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is not None and spec.name != "__main__":  # started as `python -m package.module`
        return _run_worker.command(["-m", spec.name, *sys.argv[1:]])
    main_file = getattr(__main__, "__file__", None)
    # `python - < code.py` sets __file__ to "<stdin>": no file a child could re-run, like a notebook or REPL.
    if main_file is None or not Path(main_file).is_file():
        raise RuntimeError(
            "Fabric(strategy='ddp').launch(): this strategy re-runs your script in new processes, but this "
            "session has no script file (a notebook or an interactive shell). Use strategy='ddp_notebook' "
            "(or 'ddp_spawn') and pass a function to fabric.launch(fn)."
        )
    return _run_worker.command([str(Path(main_file).resolve()), *sys.argv[1:]])


class SubprocessScriptLauncher(Launcher):
    """Starts the children with Popen and ends the whole job as soon as one of them fails."""

    def __init__(self, num_processes: int, num_nodes: int, node_rank: int, main_address: str, main_port: int):
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.node_rank = node_rank
        self.main_address = main_address
        self.main_port = main_port
        self.procs: list[subprocess.Popen] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ending = False
        self._main_failed = False
        self._failure_dir: str | None = None
        self._stderr: Any = sys.stderr

    @property
    def is_interactive_compatible(self) -> bool:
        """No: the children need a script to re-run."""
        return False

    @property
    def continues_script(self) -> bool:
        """Every process runs the whole script, so `launch()` may be called without a function."""
        return True

    def launch(self, function: Callable[..., Any], *args: Any) -> Any:
        """Start ranks 1..N-1, then run `function` here as local rank 0."""
        # One process re-runs nothing, so it needs no script file (a notebook may use strategy='ddp' on 1 device).
        command = _script_command() if self.num_processes > 1 else []
        self._stderr = sys.stderr
        if self.num_processes > 1:
            self._failure_dir = tempfile.mkdtemp(prefix="fabric-failures-")
        for local_rank in range(1, self.num_processes):
            self.procs.append(self._start(command, local_rank))
        if self.procs:
            threading.Thread(target=self._watch, name="fabric-child-watcher", daemon=True).start()
            atexit.register(self._at_exit)
            self._chain_excepthook()
            # A preemption signal to this process (rank 0) reaches every rank; each decides what it means.
            for signum in _signals.preemption_signals():
                _signals.add_forwarder(signum, self._forward)
        return function(*args)

    def _forward(self, signum: int) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def _start(self, command: list[str], local_rank: int) -> subprocess.Popen:
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=self.main_address,
            MASTER_PORT=str(self.main_port),
            NODE_RANK=str(self.node_rank),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=str(self.num_processes * self.num_nodes),
        )
        # The worker entry asks Linux to end the child when this process dies (no preexec_fn: this process may
        # already run threads, and code between fork and exec must not take their locks).
        env[_run_worker.PARENT_PID_ENV] = str(os.getpid())
        # rank_zero_only reads it before any group exists, so a child skips what the script prints before launch.
        env[_run_worker.LAUNCHED_RANK_ENV] = str(self.node_rank * self.num_processes + local_rank)
        if self._failure_dir is not None:
            env[FAILURE_DIR_ENV] = self._failure_dir
        hydra_overrides, cwd = _hydra.child_overrides(local_rank)
        return subprocess.Popen([*command, *hydra_overrides], env=env, cwd=cwd)

    def _watch(self) -> None:
        """End the job when a child fails, instead of letting the others hang in a collective."""
        while not self._stop.is_set():
            failed = self._first_failed_child()
            if failed is not None:
                self._fail(*failed)
                return
            if all(proc.poll() is not None for proc in self.procs):
                return
            time.sleep(_POLL_SECONDS)

    def _fail(self, local_rank: int, proc: subprocess.Popen, code: int) -> None:
        if self._main_failed:
            return  # rank 0 is failing: its excepthook names the rank to blame, its exit hook ends the children
        # Written to the stream saved at launch: torch's excepthook swaps sys.stderr for a StringIO while
        # rank 0 prints its own traceback, and os._exit would drop whatever this thread wrote into it.
        if self._report(local_rank, proc, code, "", self._stderr):
            self._terminate_children()
            os._exit(1)

    def _report(self, local_rank: int, proc: subprocess.Popen, code: int, more: str, stream: Any = None) -> bool:
        """Print, once for the whole job, which rank failed and what is known of how; False if already done."""
        with self._lock:
            if self._ending:
                return False
            self._ending = True
        rank = self.node_rank * self.num_processes + local_rank
        recorded = local_rank in read_failures(self._failure_dir)
        how = describe_exit(code, recorded, proc.pid in read_finished(self._failure_dir))
        sys.stdout.flush()
        print(
            f"[fabric] The process with global rank {rank} (pid {proc.pid}) {how}{more}. Ending the other processes.",
            file=stream or sys.stderr,
            flush=True,
        )
        return True

    def _terminate_children(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + _TERMINATE_GRACE_SECONDS
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def _chain_excepthook(self) -> None:
        """If rank 0 raises, its peers would wait for it in a collective: end them at once."""
        previous = sys.excepthook

        def hook(*exc_info: Any) -> None:
            # Children that had already failed when rank 0 did; one that ends after this (for example on the
            # abort mark rank 0 leaves, with exit code 1 and no record) followed rank 0 and is not blamed.
            failed_at = time.time()
            exited_before = {rank for rank, proc in enumerate(self.procs, start=1) if proc.poll()}
            self._main_failed = True
            previous(*exc_info)
            self._blame_child_that_failed_first(failed_at, exited_before)

        sys.excepthook = hook

    def _blame_child_that_failed_first(self, failed_at: float, exited_before: set[int]) -> None:
        """Rank 0 often fails only because a child died and left the process group: name that child.

        Blamed: a child that recorded its error before rank 0 failed (children record before they leave the
        group, so the record is there by now), one killed by a signal, or one that had exited with an error already.
        """
        blamed = self._child_to_blame(failed_at, exited_before)
        # A child killed by a signal writes no record, and its exit can be missed for a moment: Popen.poll()
        # answers None while the watcher thread holds the child's wait lock. Look again briefly, or the
        # line naming the killed rank is lost (the exit hook then ends the job silently).
        deadline = time.monotonic() + _BLAME_WAIT_SECONDS
        while blamed is None and time.monotonic() < deadline:
            time.sleep(_POLL_SECONDS)
            blamed = self._child_to_blame(failed_at, exited_before)
        if blamed is not None:
            proc = self.procs[blamed - 1]
            with contextlib.suppress(subprocess.TimeoutExpired):  # let it finish writing its traceback
                proc.wait(timeout=_TERMINATE_GRACE_SECONDS)
            self._report(blamed, proc, proc.poll() or 1, ", and rank 0's error followed from it")

    def _child_to_blame(self, failed_at: float, exited_before: set[int]) -> int | None:
        recorded = {rank: moment for rank, moment in read_failures(self._failure_dir).items() if moment <= failed_at}
        if recorded:
            return min(recorded, key=lambda rank: recorded[rank])
        codes = {rank: proc.poll() for rank, proc in enumerate(self.procs, start=1)}
        killed = [rank for rank, code in codes.items() if code is not None and code < 0]
        candidates = killed or sorted(exited_before)
        return candidates[0] if candidates else None

    def _first_failed_child(self) -> tuple[int, subprocess.Popen, int] | None:
        """Once some child has exited with an error: the child that failed first (by the records children write),
        once it has finished printing."""
        recorded = read_failures(self._failure_dir)
        exited = [rank for rank, proc in enumerate(self.procs, start=1) if proc.poll()]
        if not exited:
            return None
        local_rank = min(recorded, key=lambda rank: recorded[rank]) if recorded else exited[0]
        proc = self.procs[local_rank - 1]
        # Let it finish writing its traceback before anything is terminated.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=_TERMINATE_GRACE_SECONDS)
        return local_rank, proc, proc.poll() or 1

    def _at_exit(self) -> None:
        """Wait for children that finish normally; end them if this process failed."""
        try:
            if self._main_failed:
                with self._lock:
                    self._ending = True
                self._stop.set()
                self._terminate_children()
                return
            for local_rank, proc in enumerate(self.procs, start=1):
                code = proc.wait()
                if code:
                    self._fail(*(self._first_failed_child() or (local_rank, proc, code)))
            self._stop.set()
        finally:
            if self._failure_dir is not None:
                shutil.rmtree(self._failure_dir, ignore_errors=True)
