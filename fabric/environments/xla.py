"""XLAEnvironment: ranks and world size as torch_xla's runtime reports them inside processes it launched."""

from __future__ import annotations

import os
import sys

from fabric.environments.cluster_environment import ClusterEnvironment


def launched_xla_rank() -> int | None:
    """This process's global rank if torch_xla's launcher started it (it sets PJRT_LOCAL_PROCESS_COUNT), else None.

    Never imports torch_xla: a process that did not import it was not started by its launcher.
    """
    # sys.modules first: a process without torch_xla (almost every one) then pays no os.environ miss (a KeyError).
    if sys.modules.get("torch_xla") is None or "PJRT_LOCAL_PROCESS_COUNT" not in os.environ:
        return None
    from torch_xla import runtime as xr

    return int(xr.global_ordinal())


class XLAEnvironment(ClusterEnvironment):
    """Who this process is among the processes torch_xla's launcher started (one per XLA device).

    Ask it only inside a launched process: the runtime's answers in the launching process would start the runtime
    there, and torch_xla refuses to launch afterwards.
    """

    @property
    def creates_processes_externally(self) -> bool:
        """fabric's XLA launcher (torch_xla's spawn) starts the processes."""
        return False

    @property
    def main_address(self) -> str:
        """Not used: torch_xla's runtime finds its peers itself."""
        raise RuntimeError(
            "XLAEnvironment.main_address: torch_xla's runtime connects the processes itself, so there is no main "
            "address. Read ranks through XLAEnvironment.global_rank() instead."
        )

    @property
    def main_port(self) -> int:
        """Not used: torch_xla's runtime finds its peers itself."""
        raise RuntimeError(
            "XLAEnvironment.main_port: torch_xla's runtime connects the processes itself, so there is no main "
            "port. Read ranks through XLAEnvironment.global_rank() instead."
        )

    @staticmethod
    def detect() -> bool:
        """True on a TPU host with torch_xla installed; XLA strategies use this environment whatever it says."""
        from fabric.accelerators.xla import on_tpu_host

        return on_tpu_host()

    def world_size(self) -> int:
        """All processes on all hosts."""
        from torch_xla import runtime as xr

        return int(xr.world_size())

    def global_rank(self) -> int:
        """This process's ordinal among all."""
        from torch_xla import runtime as xr

        return int(xr.global_ordinal())

    def local_rank(self) -> int:
        """This process's ordinal on its host."""
        from torch_xla import runtime as xr

        return int(xr.local_ordinal())

    def node_rank(self) -> int:
        """This host's index."""
        from torch_xla import runtime as xr

        return int(xr.host_index())
