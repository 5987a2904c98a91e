"""`ddp`: re-run the user's script in new processes for local ranks 1..N-1; this process is rank 0."""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fabric.strategies.launchers.launcher import Launcher

_POLL_SECONDS = 0.1
_TERMINATE_GRACE_SECONDS = 5.0


def _script_command() -> list[str]:
    """The command that started this process, so the children run the same thing."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is not None and spec.name != "__main__":  # started as `python -m package.module`
        return [sys.executable, "-m", spec.name, *sys.argv[1:]]
    main_file = getattr(__main__, "__file__", None)
    if main_file is None:
        raise RuntimeError(
            "Fabric(strategy='ddp').launch(): this strategy re-runs your script in new processes, but this "
            "session has no script file (a notebook or an interactive shell). Use strategy='ddp_notebook' "
            "(or 'ddp_spawn') and pass a function to fabric.launch(fn)."
        )
    return [sys.executable, str(Path(main_file).resolve()), *sys.argv[1:]]


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
        command = _script_command()
        for local_rank in range(1, self.num_processes):
            self.procs.append(self._start(command, local_rank))
        if self.procs:
            threading.Thread(target=self._watch, name="fabric-child-watcher", daemon=True).start()
            atexit.register(self._at_exit)
            self._chain_excepthook()
        return function(*args)

    def _start(self, command: list[str], local_rank: int) -> subprocess.Popen:
        env = dict(os.environ)
        env.update(
            MASTER_ADDR=self.main_address,
            MASTER_PORT=str(self.main_port),
            NODE_RANK=str(self.node_rank),
            LOCAL_RANK=str(local_rank),
            WORLD_SIZE=str(self.num_processes * self.num_nodes),
        )
        return subprocess.Popen(command, env=env, preexec_fn=_die_with_parent)

    def _watch(self) -> None:
        """End the job when a child fails, instead of letting the others hang in a collective."""
        while not self._stop.is_set():
            for local_rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code:
                    self._fail(local_rank, proc, code)
                    return
            if all(proc.poll() is not None for proc in self.procs):
                return
            time.sleep(_POLL_SECONDS)

    def _fail(self, local_rank: int, proc: subprocess.Popen, code: int) -> None:
        with self._lock:
            if self._ending:
                return
            self._ending = True
        rank = self.node_rank * self.num_processes + local_rank
        how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
        sys.stdout.flush()
        print(
            f"[fabric] The process with global rank {rank} (pid {proc.pid}) {how}; its traceback is above. "
            "Ending the other processes.",
            file=sys.stderr,
            flush=True,
        )
        self._terminate_children()
        os._exit(1)

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
            self._main_failed = True
            previous(*exc_info)

        sys.excepthook = hook

    def _at_exit(self) -> None:
        """Wait for children that finish normally; end them if this process failed."""
        if self._main_failed:
            with self._lock:
                self._ending = True
            self._stop.set()
            self._terminate_children()
            return
        for local_rank, proc in enumerate(self.procs, start=1):
            code = proc.wait()
            if code:
                self._fail(local_rank, proc, code)
        self._stop.set()


def _die_with_parent() -> None:
    """Ask Linux to SIGTERM this child if the parent dies, so no rank is left orphaned."""
    if sys.platform != "linux":
        return
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
