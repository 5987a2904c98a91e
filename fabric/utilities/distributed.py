"""Thin helpers over torch.distributed used by the parallel strategies."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fabric.utilities.exceptions import FabricValueError
from fabric.utilities.shared_filesystem import is_shared_filesystem as is_shared_filesystem  # Lightning's path
from fabric.utilities.types import ReduceOp as ReduceOp  # Lightning's path

_MIN_RENDEZVOUS_TIMEOUT = timedelta(minutes=5)
_REDUCE_OPS = {"sum": "SUM", "mean": "SUM", "avg": "SUM", "max": "MAX", "min": "MIN", "product": "PRODUCT"}


def check_reduce_op(reduce_op: Any) -> str:
    """Normalise the reduce_op argument, rejecting anything we cannot honour."""
    if isinstance(reduce_op, dist.ReduceOp):
        for name, member in (
            ("sum", dist.ReduceOp.SUM),
            ("max", dist.ReduceOp.MAX),
            ("min", dist.ReduceOp.MIN),
        ):
            if reduce_op == member:
                return name
    name = str(reduce_op).lower()
    if name not in _REDUCE_OPS:
        raise FabricValueError(
            f"all_reduce(reduce_op={reduce_op!r}): unknown reduction. Use one of 'mean', 'sum', 'max', 'min'."
        )
    return "mean" if name == "avg" else name


def all_reduce(tensor: Tensor, reduce_op: Any, world_size: int, group: Any | None = None) -> Tensor:
    """Reduce a copy of `tensor` across the group; 'mean' divides the sum by the group size."""
    op_name = check_reduce_op(reduce_op)
    result = tensor.clone()
    if op_name == "mean" and not torch.is_floating_point(result):
        result = result.float()
    dist.all_reduce(result, op=getattr(dist.ReduceOp, _REDUCE_OPS[op_name]), group=group)
    if op_name == "mean":
        size = dist.get_world_size(group) if group is not None else world_size
        result = result / size
    return result


def all_gather(tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
    """Stack every process's tensor along a new first dimension; with sync_grads the result is differentiable."""
    if tensor.dim() == 0:
        tensor = tensor.unsqueeze(0)
        squeeze = True
    else:
        squeeze = False
    tensor = tensor.contiguous()
    if sync_grads:
        gathered = _DifferentiableAllGather.apply(tensor, group)
    else:
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        gathered = torch.stack(parts)
    return gathered.squeeze(1) if squeeze else gathered


class _DifferentiableAllGather(torch.autograd.Function):
    """all_gather whose backward sends each rank the summed gradient of its own slice.

    Written on the public collectives: torch's autograd-aware variants are private or deprecated.
    """

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any | None) -> Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, tensor, group=group)
        return torch.stack(parts)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank], None


def init_process_group(
    backend: str,
    main_address: str,
    main_port: int,
    world_size: int,
    rank: int,
    timeout: timedelta,
    device_id: torch.device | None = None,
) -> Any:
    """Join the default process group over a TCP rendezvous at main_address:main_port; return its store.

    The store gets at least _MIN_RENDEZVOUS_TIMEOUT: `timeout` is meant for collectives, and a short one
    (seconds, to fail fast when a rank is stuck) would otherwise fail the start while the other processes
    are still importing torch. On a loopback main address (every single-machine job fabric launches) rank 0
    serves the store on that address only, so no other host can reach it.
    """
    store_timeout = max(timeout, _MIN_RENDEZVOUS_TIMEOUT)
    store = serve_store_on_loopback(main_address, main_port, world_size, store_timeout) if rank == 0 else None
    if store is None:
        host = f"[{main_address}]" if ":" in main_address else main_address
        # torch's own tcp:// handler, so torchrun's agent store and multi-tenant stores work as before.
        store, _, _ = next(dist.rendezvous(f"tcp://{host}:{main_port}", rank, world_size, timeout=store_timeout))
    store.set_timeout(timeout)  # what init_process_group does after its own rendezvous
    dist.init_process_group(
        backend=backend, store=store, world_size=world_size, rank=rank, timeout=timeout, device_id=device_id
    )
    return store


def serve_store_on_loopback(address: str, port: int, world_size: int, timeout: timedelta) -> Any:
    """A TCPStore server listening on `address` alone when it is a loopback address; else None.

    torch's TCPStore server listens on every interface, whatever address it is given, and anyone who reaches the
    port can read and write every key (fabric's preemption and abort keys included). Handing it a socket bound to
    the loopback address keeps it on this machine. None also when torchrun's agent serves the store (its workers
    only connect) or the port is taken (torch's own rendezvous then reports it, or reuses a store of this process).
    """
    import socket

    if _agent_serves_store():
        return None
    try:
        infos = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
    except OSError:
        return None
    if not infos or not all(_is_loopback(str(info[4][0])) for info in infos):
        return None
    family, kind, proto, _, sockaddr = infos[0]
    listener = socket.socket(family, kind, proto)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch does: TIME_WAIT does not block
        listener.bind(sockaddr)
        listener.listen(socket.SOMAXCONN)
    except OSError:
        listener.close()
        return None
    # The store owns the descriptor from here on and closes it with the server.
    fd = listener.detach()
    return dist.TCPStore(address, port, world_size, True, timeout, multi_tenant=True, master_listen_fd=fd)


def _is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def _agent_serves_store() -> bool:
    """Whether torchrun's agent hosts the store its workers join (torch's own test; assume so if it is gone)."""
    import importlib

    check = getattr(importlib.import_module("torch.distributed.rendezvous"), "_torchelastic_use_agent_store", None)
    return check is None or bool(check())


def default_store() -> Any:
    """The store of a default process group that someone else created, or None when torch does not say."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


@contextmanager
def explain_timeout(operation: str, waited: str, setting: str) -> Iterator[None]:
    """Turn torch's bare collective timeout into an error that names the operation and how to wait longer.

    `waited` says how long (e.g. "0:00:03"), `setting` the call that sets it (e.g. "DDPStrategy(timeout=...)").
    gloo raises a RuntimeError ("Timed out waiting 3000ms for recv operation ...") from barrier, broadcast,
    all_gather and all_reduce alike (checked with torch 2.13); NCCL raises DistBackendError, a RuntimeError too.
    Other errors (a peer that left: "Connection closed by peer") pass through unchanged.
    """
    try:
        yield
    except RuntimeError as err:
        text = str(err).lower()
        # An error fabric.diagnostics already explained (a recorded collective nested in this one) stays as it is.
        if ("timed out" not in text and "timeout" not in text) or getattr(err, "_fabric_collective_explained", False):
            raise
        longer = setting.replace("...", "timedelta(minutes=...)")
        raise RuntimeError(
            f"fabric.{operation}() timed out after {waited} waiting for the other processes ({setting}). "
            "A process may have died or be stuck, e.g. in a long computation or in a different collective; "
            f"check the other processes' output. Pass {longer} to wait longer."
        ) from err
