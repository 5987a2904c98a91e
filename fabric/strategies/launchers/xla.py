"""XLALauncher: one process per XLA device through torch_xla's own launcher (`xmp.spawn`)."""

from __future__ import annotations

import copy
import queue
import time
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from fabric.strategies.launchers.launcher import Launcher
from fabric.utilities.exceptions import FabricValueError

# torch_xla's runtime of the first process serves the others; if it exits first, the others can fail while they
# leave the final rendezvous (pytorch/xla#2190), so it lingers this long after everyone arrived.
_RANK_ZERO_LINGER_SECONDS = 1.0


class XLALauncher(Launcher):
    """Runs a function in every process torch_xla starts on this host and returns local rank 0's result.

    torch_xla starts either one process (`num_processes=1`: the function runs in this very process) or one per
    device of the host; it cannot start a subset. Its processes are forked by default, so the function and its
    arguments need not be importable, but they must be picklable (torch_xla sends them to a process pool).
    """

    def __init__(self, num_processes: int, start_method: str = "fork") -> None:
        if num_processes < 1:
            raise FabricValueError(f"XLALauncher(num_processes={num_processes}): at least one process is needed.")
        if start_method not in ("fork", "spawn", "forkserver"):
            raise FabricValueError(
                f"XLALauncher(start_method={start_method!r}): torch_xla starts processes with 'fork', 'spawn' or "
                "'forkserver'. Pass one of them."
            )
        self.num_processes = num_processes
        self.start_method = start_method

    @property
    def is_interactive_compatible(self) -> bool:
        """Forked processes work from a notebook."""
        return self.start_method == "fork"

    @property
    def continues_script(self) -> bool:
        """The processes run only the function given to `launch`."""
        return False

    def launch(self, function: Callable[..., Any], *args: Any) -> Any:
        """Start the processes, run `function(*args)` in each, and return the result of local rank 0."""
        import torch_xla.distributed.xla_multiprocessing as xmp

        with mp.Manager() as manager:
            results = manager.Queue()
            # torch_xla accepts nprocs=1 (run here) or None (one process per device); any other count is refused.
            nprocs = 1 if self.num_processes == 1 else None
            xmp.spawn(_run_in_process, args=(function, args, results), nprocs=nprocs, start_method=self.start_method)
            try:
                return results.get_nowait()
            except queue.Empty:
                return None


def _run_in_process(process_index: int, function: Callable[..., Any], args: tuple, results: Any) -> None:
    """What every launched process runs; `process_index` is torch_xla's global ordinal."""
    import torch_xla.core.xla_model as xm
    from torch_xla import runtime as xr

    if len(xm.get_xla_supported_devices()) > 1:
        # TPU v2/v3 drive two devices per process from two threads, which must not share the same objects.
        function, args = copy.deepcopy((function, args))
    result = function(*args)
    local_rank = int(xr.local_ordinal())
    if local_rank == 0:
        results.put(_to_cpu(result))
    # Nobody leaves before everyone finished, and the process hosting the runtime leaves last.
    xm.rendezvous("fabric-launch-end")
    if local_rank == 0 and int(xr.world_size()) > 1:
        time.sleep(_RANK_ZERO_LINGER_SECONDS)


def _to_cpu(result: Any) -> Any:
    # XLA tensors cannot cross a process boundary; CPU copies can.
    from fabric.io.xla import xla_state_to_cpu

    return xla_state_to_cpu(result)
