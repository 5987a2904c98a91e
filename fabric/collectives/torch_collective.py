"""TorchCollective: the Collective role over torch.distributed, for code that communicates without a Fabric."""

from __future__ import annotations

import datetime
import os
from typing import Any

import torch.distributed as dist
from torch import Tensor
from typing_extensions import Self

from fabric.collectives.collective import Collective
from fabric.utilities.exceptions import FabricTypeError, FabricValueError
from fabric.utilities.types import CollectibleGroup


class TorchCollective(Collective):
    """Collectives of ``torch.distributed`` over this object's group, or the default group when it has none.

    ``setup(main_address=, main_port=, **init_process_group_kwargs)`` creates the default group if no one
    has; the object that created it destroys it in ``teardown()``. Ranks passed as ``src``/``dst`` are
    global ranks, as in ``torch.distributed``.
    """

    addr_key = "MASTER_ADDR"
    port_key = "MASTER_PORT"

    def __init__(self) -> None:
        if not dist.is_available():
            raise RuntimeError(
                "TorchCollective(): this torch was built without torch.distributed, so no process can talk to "
                "another. Install a torch build with distributed support."
            )
        super().__init__()
        # Whether this object created the default group; kept per object, not per class, so two users of
        # collectives in one process (say, a library and the script) never destroy each other's group.
        self._owns_default_group = False

    @property
    def group(self) -> CollectibleGroup:
        """This object's group, or the default group."""
        if self._group is not None:
            return self._group
        return dist.GroupMember.WORLD  # type: ignore[return-value]

    @property
    def rank(self) -> int:
        """This process's rank within the group."""
        return dist.get_rank(self.group)  # type: ignore[arg-type]

    @property
    def world_size(self) -> int:
        """The number of processes in the group."""
        return dist.get_world_size(self.group)  # type: ignore[arg-type]

    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        """Copy ``src``'s tensor into every process's ``tensor``."""
        dist.broadcast(tensor, src, group=self.group)  # type: ignore[arg-type]
        return tensor

    def all_reduce(self, tensor: Tensor, op: Any = "sum") -> Tensor:
        """Reduce ``tensor`` in place on every process (``op``: a ReduceOp or its name, such as ``"sum"``)."""
        dist.all_reduce(tensor, op=self._convert_to_native_op(op), group=self.group)
        return tensor

    def reduce(self, tensor: Tensor, dst: int, op: Any = "sum") -> Tensor:
        """Reduce ``tensor`` into ``dst``'s tensor."""
        dist.reduce(tensor, dst, op=self._convert_to_native_op(op), group=self.group)  # type: ignore[arg-type]
        return tensor

    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor) -> list[Tensor]:
        """Fill ``tensor_list`` with every process's ``tensor``."""
        dist.all_gather(tensor_list, tensor, group=self.group)
        return tensor_list

    def gather(self, tensor: Tensor, gather_list: list[Tensor], dst: int = 0) -> list[Tensor]:
        """Fill ``dst``'s ``gather_list`` with every process's ``tensor`` (others pass an empty list)."""
        dist.gather(tensor, gather_list, dst, group=self.group)  # type: ignore[arg-type]
        return gather_list

    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], src: int = 0) -> Tensor:
        """Give process i the i-th tensor of ``src``'s ``scatter_list`` (others pass an empty list)."""
        dist.scatter(tensor, scatter_list, src, group=self.group)  # type: ignore[arg-type]
        return tensor

    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], op: Any = "sum") -> Tensor:
        """Reduce the i-th input of every process into process i's ``output``."""
        native = self._convert_to_native_op(op)
        dist.reduce_scatter(output, input_list, op=native, group=self.group)
        return output

    def all_to_all(self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor]) -> list[Tensor]:
        """Send the i-th input to process i; receive process j's tensor into the j-th output."""
        dist.all_to_all(output_tensor_list, input_tensor_list, group=self.group)
        return output_tensor_list

    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to process ``dst``."""
        dist.send(tensor, dst, group=self.group, tag=tag)  # type: ignore[arg-type]

    def recv(self, tensor: Tensor, src: int | None = None, tag: int = 0) -> Tensor:
        """Receive into ``tensor`` from ``src`` (any process when None)."""
        dist.recv(tensor, src, group=self.group, tag=tag)  # type: ignore[arg-type]
        return tensor

    def all_gather_object(self, object_list: list[Any], obj: Any) -> list[Any]:
        """Fill ``object_list`` with every process's picklable ``obj``."""
        dist.all_gather_object(object_list, obj, group=self.group)
        return object_list

    def broadcast_object_list(self, object_list: list[Any], src: int, device: Any = None) -> list[Any]:
        """Replace ``object_list`` on every process by ``src``'s."""
        dist.broadcast_object_list(object_list, src, group=self.group, device=device)  # type: ignore[arg-type]
        return object_list

    def gather_object(self, obj: Any, object_gather_list: list[Any], dst: int = 0) -> list[Any]:
        """Fill ``dst``'s ``object_gather_list`` with every process's ``obj``."""
        dist.gather_object(obj, object_gather_list, dst, group=self.group)  # type: ignore[arg-type]
        return object_gather_list

    def scatter_object_list(
        self, scatter_object_output_list: list[Any], scatter_object_input_list: list[Any], src: int = 0
    ) -> list[Any]:
        """Put the i-th object of ``src``'s input list into process i's one-element output list."""
        group = self.group
        dist.scatter_object_list(scatter_object_output_list, scatter_object_input_list, src, group=group)  # type: ignore[arg-type]
        return scatter_object_output_list

    def barrier(self, device_ids: list[int] | None = None) -> None:
        """Wait for every process of the group (a non-member returns at once)."""
        if self.group == dist.GroupMember.NON_GROUP_MEMBER:
            return
        dist.barrier(group=self.group, device_ids=device_ids)  # type: ignore[arg-type]

    def monitored_barrier(self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
        """A barrier that names the ranks that did not arrive within ``timeout`` (gloo only)."""
        dist.monitored_barrier(group=self.group, timeout=timeout, wait_all_ranks=wait_all_ranks)  # type: ignore[arg-type]

    def setup(self, main_address: str | None = None, main_port: str | int | None = None, **kwargs: Any) -> Self:
        """Create the default group (``kwargs`` go to ``init_process_group``) unless it exists already.

        ``main_address``/``main_port`` are used when MASTER_ADDR/MASTER_PORT are not set.
        """
        if self.is_initialized():
            return self
        added = {}
        if main_address is not None and self.addr_key not in os.environ:
            added[self.addr_key] = main_address
        if main_port is not None and self.port_key not in os.environ:
            added[self.port_key] = str(main_port)
        os.environ.update(added)
        try:
            self.init_group(**kwargs)
        finally:
            for key in added:  # init_process_group has read them; leave the environment as it was
                os.environ.pop(key, None)
        self._owns_default_group = True
        return self

    def teardown(self) -> Self:
        """Destroy this object's group, and the default group if this object created it."""
        if self._group is None and not self._owns_default_group:
            raise RuntimeError(
                "TorchCollective.teardown(): this collective neither created a group (create_group) nor the "
                "default group (setup), so it has nothing to destroy."
            )
        if self._group is not None:
            super().teardown()
        if self._owns_default_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_default_group = False
        return self

    @classmethod
    def is_available(cls) -> bool:
        """Whether torch.distributed is built in."""
        return dist.is_available()

    @classmethod
    def is_initialized(cls) -> bool:
        """Whether the default group exists."""
        return dist.is_available() and dist.is_initialized()

    @classmethod
    def init_group(cls, **kwargs: Any) -> None:
        """``torch.distributed.init_process_group(**kwargs)``."""
        dist.init_process_group(**kwargs)

    @classmethod
    def new_group(cls, **kwargs: Any) -> CollectibleGroup:
        """``torch.distributed.new_group(**kwargs)``."""
        return dist.new_group(**kwargs)

    @classmethod
    def destroy_group(cls, group: CollectibleGroup) -> None:
        """Destroy ``group``; processes outside it (which hold a placeholder) do nothing."""
        if group in dist.distributed_c10d._pg_map:
            dist.destroy_process_group(group)

    @classmethod
    def _convert_to_native_op(cls, op: Any) -> Any:
        """A ``ReduceOp`` from a ReduceOp or its case-insensitive name (``"sum"``, ``"max"``, ``"avg"``, ...)."""
        if isinstance(op, (dist.ReduceOp, dist.ReduceOp.RedOpType)):
            return op
        if not isinstance(op, str):
            raise FabricTypeError(
                f"TorchCollective: op={op!r} is a {type(op).__name__}. Pass a torch.distributed.ReduceOp or its "
                "name, such as 'sum'."
            )
        native = getattr(dist.ReduceOp, op.upper(), None)
        if native is None:
            raise FabricValueError(
                f"TorchCollective: op={op!r} is not a torch.distributed.ReduceOp. Use one of: sum, product, min, "
                "max, band, bor, bxor, avg (avg needs NCCL)."
            )
        return native
