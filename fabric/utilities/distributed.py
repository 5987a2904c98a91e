"""Thin helpers over torch.distributed used by the parallel strategies."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

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
        raise ValueError(
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
    backend: str, main_address: str, main_port: int, world_size: int, rank: int, timeout: timedelta
) -> None:
    """Join the default process group over a TCP rendezvous at main_address:main_port."""
    host = f"[{main_address}]" if ":" in main_address else main_address
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{host}:{main_port}",
        world_size=world_size,
        rank=rank,
        timeout=timeout,
    )
