"""`ddp_spawn`, `ddp_fork`, `ddp_notebook`: start the workers with torch.multiprocessing."""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from fabric.strategies.launchers._process import die_with_parent
from fabric.strategies.launchers.launcher import Launcher
from fabric.utilities import _signals
from fabric.utilities.exceptions import FabricValueError

_POLL_SECONDS = 0.05
_TERMINATE_GRACE_SECONDS = 5.0
# A worker's traceback travels through a pipe; keep it well under the pipe buffer so put() never blocks.
_MAX_TRACEBACK_CHARS = 16_000


class MultiProcessingLauncher(Launcher):
    """Runs a function in N new processes and returns rank 0's result; any failure ends them all."""

    def __init__(
        self,
        num_processes: int,
        num_nodes: int,
        node_rank: int,
        main_address: str,
        main_port: int,
        start_method: str = "spawn",
    ) -> None:
        if start_method not in mp.get_all_start_methods():
            raise FabricValueError(
                f"start_method={start_method!r}: not available on this platform (available: "
                f"{mp.get_all_start_methods()}). Use 'spawn', or 'ddp_spawn' as the strategy."
            )
        self.num_processes = num_processes
        self.num_nodes = num_nodes
        self.node_rank = node_rank
        self.main_address = main_address
        self.main_port = main_port
        self.start_method = start_method

    @property
    def is_interactive_compatible(self) -> bool:
        """Fork works from a notebook; spawn needs importable functions."""
        return self.start_method == "fork"

    @property
    def continues_script(self) -> bool:
        """The workers only run the function given to `launch`."""
        return False

    def launch(self, function: Callable[..., Any], *args: Any) -> Any:
        """Start the workers, wait for all, and return rank 0's result."""
        if self.start_method == "fork":
            _check_no_cuda_before_fork()
        ctx = mp.get_context(self.start_method)
        results, failures = ctx.SimpleQueue(), ctx.SimpleQueue()
        # A spawned process starts from scratch; give it the caller's RNG and determinism settings, as fork does.
        state = _GlobalState.capture() if self.start_method != "fork" else None
        env = {
            "MASTER_ADDR": self.main_address,
            "MASTER_PORT": str(self.main_port),
            "NODE_RANK": str(self.node_rank),
            "WORLD_SIZE": str(self.num_processes * self.num_nodes),
        }
        context = mp.start_processes(
            _worker,
            args=(os.getpid(), env, state, function, args, results, failures),
            nprocs=self.num_processes,
            start_method=self.start_method,
            join=False,
        )
        payload = None
        # A preemption signal to this waiting process goes on to the workers, which decide what it means; this
        # process keeps waiting for them (they may be saving a checkpoint) instead of dying of it.
        forward = _Forwarder(context.processes)
        signals = _signals.preemption_signals()
        for signum in signals:
            _signals.add_forwarder(signum, forward)
            _signals.add_catcher(signum, _keep_waiting)
        try:
            while not context.join(timeout=_POLL_SECONDS):
                # Drain the result while rank 0 still runs: a result larger than the pipe buffer would
                # otherwise block rank 0 in put() while we wait for it to exit.
                if payload is None and not results.empty():
                    payload = results.get()
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            raise RuntimeError(self._describe_failure(err, failures)) from None
        except BaseException:
            # Ctrl-C (or any error) here: torch's workers are not daemons, so without this the interpreter
            # would wait at exit for workers that keep training, and a worker in a collective waits forever.
            _end_workers(context.processes)
            raise
        finally:
            for signum in signals:
                _signals.remove_catcher(signum, _keep_waiting)
                _signals.remove_forwarder(signum, forward)
            _remove_error_files(context)
        if payload is None and not results.empty():
            payload = results.get()
        return pickle.loads(payload) if payload is not None else None

    def _describe_failure(self, err: Exception, failures: Any) -> str:
        """Name the rank that failed first: the others often fail only because it left the process group."""
        records, returned = [], set()
        while not failures.empty():
            record = pickle.loads(failures.get())
            if record[2] is None:  # the rank's function returned
                returned.add(record[1])
            else:
                records.append(record)
        recorded_ranks = {local_rank for _, local_rank, _ in records}
        if isinstance(err, mp.ProcessExitedException) and err.error_index not in recorded_ranks:
            # Killed or exited without raising: it could not record anything, and its peers broke after it.
            how = f"was killed by {err.signal_name}" if err.signal_name else f"exited with code {err.exit_code}"
            if err.error_index in returned:  # e.g. an abort in torch's teardown: no Python error to show
                how += " while exiting, after its function had returned (it recorded no Python error)"
            local_rank, details = err.error_index, ""
        elif records:
            _, local_rank, details = min(records)
            how = "raised an exception"
        else:
            local_rank, how, details = getattr(err, "error_index", 0), "raised an exception", getattr(err, "msg", "")
        rank = self.node_rank * self.num_processes + local_rank
        text = f"fabric.launch(): the process with global rank {rank} {how}; the other processes were ended."
        return f"{text}\n{details.strip()}" if details else text


def _worker(
    local_rank: int,
    parent_pid: int,
    env: dict[str, str],
    state: _GlobalState | None,
    function: Callable,
    args: tuple,
    results: Any,
    failures: Any,
) -> None:
    """Entry point of each worker: say who it is (like torchrun does), run, hand back rank 0's result."""
    # If the parent is killed outright (SIGKILL, OOM killer), nothing can end the workers: ask Linux to.
    die_with_parent(parent_pid)
    if state is not None:
        state.restore()
    os.environ.update(env)
    os.environ["LOCAL_RANK"] = str(local_rank)
    try:
        result = function(*args)
    except BaseException as err:
        # Recorded before this process leaves the process group, so it is earlier than any error it causes.
        details = traceback.format_exc()[-_MAX_TRACEBACK_CHARS:]
        failures.put(pickle.dumps((time.time(), local_rank, details)))
        if isinstance(err, Exception):
            # Exit instead of raising: torch's wrapper would pickle the traceback into a world-readable
            # pytorch-errorfile-*.pickle in the temp folder; the launcher has it from the record already.
            raise SystemExit(1) from None
        raise
    failures.put(pickle.dumps((time.time(), local_rank, None)))  # returned: a later death happened while exiting
    if local_rank == 0 and env["NODE_RANK"] == "0":
        # Plain pickle bytes: torch's queue would pass tensors as shared-memory handles that die with this process.
        results.put(pickle.dumps(_to_cpu(result)))


class _Forwarder:
    """Passes a signal on to the workers still running."""

    def __init__(self, processes: list[Any]) -> None:
        self.processes = processes

    def __call__(self, signum: int) -> None:
        for process in self.processes:
            if process.is_alive() and process.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signum)


def _remove_error_files(context: Any) -> None:
    """Delete the traceback files torch's wrapper writes for ranks that raised (anything the worker let through)."""
    for path in getattr(context, "error_files", []):
        with contextlib.suppress(OSError, TypeError):
            Path(path).unlink()


def _keep_waiting(signum: int) -> None:
    """The launcher survives a preemption signal: the workers' exit decides the job's."""


def _end_workers(processes: list[Any]) -> None:
    """SIGTERM every worker still running, then SIGKILL those that ignore it within the grace period."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _TERMINATE_GRACE_SECONDS
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


class _GlobalState:
    """The process-wide torch and python settings a spawned worker would otherwise lose."""

    def __init__(self, torch_rng: torch.Tensor, python_rng: Any, deterministic: bool, warn_only: bool) -> None:
        self.torch_rng = torch_rng
        self.python_rng = python_rng
        self.deterministic = deterministic
        self.warn_only = warn_only

    @classmethod
    def capture(cls) -> _GlobalState:
        return cls(
            torch.get_rng_state(),
            random.getstate(),
            *_deterministic_flags(),
        )

    def restore(self) -> None:
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.python_rng)
        # Only a change: torch.use_deterministic_algorithms imports torch._inductor's config and with it
        # torch._dynamo, seconds of CPU in every worker of a spawn launch whose parent never changed the flags.
        if _deterministic_flags() != (self.deterministic, self.warn_only):
            torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)


def _deterministic_flags() -> tuple[bool, bool]:
    """torch.use_deterministic_algorithms' two settings in this process: (enabled, warn_only)."""
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _to_cpu(result: Any) -> Any:
    from fabric.utilities.apply_func import apply_to_collection

    return apply_to_collection(result, torch.Tensor, lambda t: t.detach().cpu())


def _check_no_cuda_before_fork() -> None:
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "Fabric(strategy='ddp_fork'/'ddp_notebook').launch(): CUDA was already initialised in this process, "
            "and a forked process cannot use CUDA after that. Move everything that touches CUDA (moving tensors "
            "or models to the GPU, torch.cuda calls) into the function you pass to fabric.launch(), restart the "
            "notebook kernel, or use strategy='ddp_spawn'."
        )
