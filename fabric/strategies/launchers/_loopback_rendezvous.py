"""`fabric run` on one machine: torchrun's static rendezvous, with its store listening on the loopback address only.

torch's TCPStore server listens on every interface, and whoever reaches the port can read and write every key of
the job's store, fabric's preemption and abort keys included. On one machine no other host needs it. Imported by
`fabric run`'s agent only (it pulls in torch's elastic modules).
"""

from __future__ import annotations

import functools
from typing import Any

from torch.distributed.elastic.rendezvous import RendezvousParameters, rendezvous_handler_registry
from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous, create_rdzv_handler

from fabric.utilities.distributed import serve_store_on_loopback


class _LoopbackRendezvous(StaticTCPRendezvous):
    """torchrun's static rendezvous whose store server (node 0's) listens on the loopback address alone."""

    backend = ""  # the name it was registered under (fabric_run.LOOPBACK_RENDEZVOUS)

    def get_backend(self) -> str:
        """The name `fabric run` passes to torchrun."""
        return self.backend

    def next_rendezvous(self) -> Any:
        """Serve the store on loopback before torch's own code would serve it on every interface."""
        if self._store is None and self.rank == 0:
            self._store = serve_store_on_loopback(self.master_addr, self.master_port, self.world_size, self.timeout)
        return super().next_rendezvous()


def _create(backend: str, params: RendezvousParameters) -> _LoopbackRendezvous:
    params.config.setdefault("rank", 0)  # one machine: node rank 0 (torchrun sets it only for "static")
    static = create_rdzv_handler(params)
    assert isinstance(static, StaticTCPRendezvous)
    handler = _LoopbackRendezvous(
        static.master_addr, static.master_port, 0, static.world_size, static.run_id, int(static.timeout.total_seconds())
    )
    handler.backend = backend
    return handler


@functools.cache
def register(backend: str) -> None:
    """Make `backend` name this rendezvous for torchrun in this process (once: torch refuses a second creator)."""
    rendezvous_handler_registry.register(backend, functools.partial(_create, backend))
