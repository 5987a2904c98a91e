"""Thin helpers over torch.distributed used by the parallel strategies."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fabric import _lazy
from fabric.utilities.direct_calls import direct_for
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


# torch 2.13 renamed all_gather_into_tensor (deprecated there, with a warning per call) to all_gather_single.
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# reduce_op strings as users pass them -> (torch's op, whether to divide by the group size): parsed once per name.
_PARSED_OPS: dict[str, tuple[Any, bool]] = {}
_WORLD_SIZE: list[Any] = [lambda: None, 0]  # (weak reference to the default group, its size)


def parse_reduce_op(reduce_op: Any) -> tuple[Any, bool]:
    """torch's ReduceOp for `reduce_op` and whether the sum must be divided by the group size ('mean')."""
    parsed = _PARSED_OPS.get(reduce_op) if isinstance(reduce_op, str) else None
    if parsed is None:
        name = check_reduce_op(reduce_op)
        parsed = (getattr(dist.ReduceOp, _REDUCE_OPS[name]), name == "mean")
        if isinstance(reduce_op, str):
            _PARSED_OPS[reduce_op] = parsed
    return parsed


def all_reduce(tensor: Tensor, reduce_op: Any, group: Any | None = None) -> Tensor:
    """Reduce a copy of `tensor` across the group; 'mean' divides the sum by the group size."""
    op, mean = parse_reduce_op(reduce_op)
    if mean and not tensor.is_floating_point():
        result = tensor.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    else:
        # The one copy the call needs (the input is left unchanged); contiguous, as the backends require.
        result = tensor.clone() if tensor.is_contiguous() else tensor.clone(memory_format=torch.contiguous_format)
    direct = direct_for(result, group)
    if direct is not None:
        direct.all_reduce(result, op)
        size = direct.size
    else:
        dist.all_reduce(result, op, group)
        size = group_size(group)
    if mean:
        result.div_(size)
    return result


def all_gather(tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
    """Stack every process's tensor along a new first dimension; with sync_grads the result is differentiable.

    One collective into a preallocated `(world_size * numel,)` buffer, viewed as `(world_size, *shape)`: the flat
    form is the one every backend accepts (gloo refuses the stacked form). Every process must pass the same shape.
    """
    if sync_grads:
        return _DifferentiableAllGather.apply(tensor, group, group_size(group))
    return gather_flat(tensor, group)


def group_size(group: Any | None) -> int:
    # The group's own size(), the default group's looked up once: dist.get_world_size(group) validates and looks
    # the group up on every call (a microsecond, which a collective of a few kilobytes notices).
    if group is not None:
        return group.size()
    world = dist.group.WORLD
    ref, size = _WORLD_SIZE
    if ref() is not world:
        size = world.size()  # type: ignore[union-attr]
        _WORLD_SIZE[:] = [weakref.ref(world), size]  # weak: the group must die with destroy_process_group
    return size


def gather_flat(tensor: Tensor, group: Any | None) -> Tensor:
    """Gather `tensor` from every process, stacked: `(world_size, *shape)`; every process passes the same shape.

    Allocated flat, gathered into, viewed stacked: the raw call's own steps (a collective of a few kilobytes on
    local ranks notices even a keyword argument or a second shape tuple).
    """
    flat = tensor.reshape(-1)  # a view where it can be, else the one copy the backend needs
    direct = direct_for(flat, group)
    size = direct.size if direct is not None else group_size(group)
    out = tensor.new_empty(size * tensor.numel())
    if direct is not None:
        direct.gather_into(out, flat)
    else:
        # Into a view: torch 2.13 refuses to gather a tensor that requires grad into the base tensor itself
        # ("a view was created in no_grad mode ...").
        _gather_single(out.view(-1), flat, group)
    return out.view(size, *tensor.shape)


class _DifferentiableAllGather(torch.autograd.Function):
    """all_gather whose backward sends each rank the summed gradient of its own slice.

    Written on the public collectives: torch.distributed.nn's gathers are deprecated (a warning per call) or have
    no backward on gloo.
    """

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, group: Any | None, world_size: int) -> Tensor:
        ctx.group = group
        ctx.rank = dist.get_rank(group)
        # The stacked tensor itself, not a view of a flat one: autograd refuses in-place changes to views made
        # inside a Function's forward (users modify gathered tensors in place).
        out = tensor.new_empty((world_size, *tensor.shape))
        _gather_single(out.view(-1), tensor.reshape(-1), group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad[ctx.rank], None, None


def release_group_last(wrapped: torch.nn.Module) -> None:
    """Make the Python handle of a DDP model's process group, not DDP's C++ Reducer, drop the group's last reference.

    A module's attributes are released in the order they were set, and DDP sets `process_group` before `reducer`
    and `logger` (which holds the reducer too). So when the model is freed after destroy_process_group, the
    Reducer dropped the group, and its destructor joined gloo's worker threads while holding the GIL; a worker
    still releasing a finished collective (one that held a tensor created in Python) waits for the GIL, and the
    process hangs for good (seen on CPU after all_gather + barrier + destroy_process_group). The Python handle
    releases the GIL in that destructor, so set last it lets the worker finish and the join return.
    """
    state = wrapped.__dict__
    if "process_group" in state:
        state["process_group"] = state.pop("process_group")


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
    """Add to torch's bare collective timeout a note that names the operation and how to wait longer.

    `waited` says how long (e.g. "0:00:03"), `setting` the call that sets it (e.g. "DDPStrategy(timeout=...)").
    gloo raises a RuntimeError ("Timed out waiting 3000ms for recv operation ...") from barrier, broadcast,
    all_gather and all_reduce alike (checked with torch 2.13); NCCL raises DistBackendError, a RuntimeError too.
    The error keeps its type (a user's `except DistBackendError` still matches); the explanation is a note.
    Other errors (a peer that left: "Connection closed by peer") pass through unchanged.
    """
    try:
        yield
    except RuntimeError as err:
        note_timeout(err, operation, waited, setting)
        raise


def note_timeout(err: RuntimeError, operation: str, waited: str, setting: str) -> None:
    """Add the timeout explanation to `err` when it is a timeout no recorded collective explained already."""
    text = str(err).lower()
    # An error fabric.diagnostics already explained (a recorded collective nested in this one) stays as it is.
    if ("timed out" not in text and "timeout" not in text) or getattr(err, "_fabric_collective_explained", False):
        return
    longer = setting.replace("...", "timedelta(minutes=...)")
    add_note(
        err,
        f"fabric.{operation}() timed out after {waited} waiting for the other processes ({setting}). "
        "A process may have died or be stuck, e.g. in a long computation or in a different collective; "
        f"check the other processes' output. Pass {longer} to wait longer.",
    )
    err._fabric_collective_explained = True  # type: ignore[attr-defined]


def add_note(err: BaseException, text: str) -> None:
    """Add `text` to `err` as a PEP 678 note, printed under its message; the error keeps its type and message.

    Python 3.10 has no notes (nor prints them): there the text is appended to the message itself.
    """
    if hasattr(err, "add_note"):
        err.add_note(text)
        return
    notes = err.__dict__.setdefault("__notes__", [])
    notes.append(text)
    if err.args and isinstance(err.args[0], str):
        err.args = (f"{err.args[0]}\n{text}", *err.args[1:])


# Lightning's private helpers, which client code imports from this path.
def _distributed_is_initialized() -> bool:
    """Whether torch.distributed is built in and a default process group exists."""
    return dist.is_available() and dist.is_initialized()


def _sync_ddp_if_available(result: Tensor, group: Any | None = None, reduce_op: Any | None = None) -> Tensor:
    """`result` reduced across the group ('sum' when `reduce_op` is None); `result` itself without a group."""
    if not _distributed_is_initialized():
        return result
    return all_reduce(result, "sum" if reduce_op is None else reduce_op, group)


def _all_gather_ddp_if_available(tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
    """Every process's `tensor` stacked along a new first dimension; `tensor` itself without a group."""
    if not _distributed_is_initialized():
        return tensor
    return all_gather(tensor.contiguous(), group, sync_grads)


def _get_default_process_group_backend_for_device(device: torch.device) -> str:
    """'nccl' for CUDA devices, 'gloo' otherwise (Lightning's choice)."""
    return "nccl" if device.type == "cuda" else "gloo"


# Lightning's path for the sampler wrapper; loaded on use, as torch.utils.data costs ~70 ms to import.
__getattr__, __dir__ = _lazy.exports(__name__, {"DistributedSamplerWrapper": "fabric.utilities.data"})
