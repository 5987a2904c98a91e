"""The Collective role: tensor communication among processes, usable on its own, without a Fabric."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from torch import Tensor
from typing_extensions import Self

from fabric.utilities.types import CollectibleGroup


class Collective(ABC):
    """Collective operations over one process group; each returns the tensor(s) holding the result."""

    def __init__(self) -> None:
        self._group: CollectibleGroup | None = None

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank within the group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """The number of processes in the group."""

    @property
    def group(self) -> CollectibleGroup:
        """The group this object communicates over."""
        if self._group is None:
            raise RuntimeError(
                f"{type(self).__name__}.group: this collective owns no group yet. Call create_group() first."
            )
        return self._group

    @abstractmethod
    def broadcast(self, tensor: Tensor, src: int) -> Tensor:
        """Copy ``src``'s tensor into every process's ``tensor``."""

    @abstractmethod
    def all_reduce(self, tensor: Tensor, op: Any) -> Tensor:
        """Reduce ``tensor`` across processes in place, on every process."""

    @abstractmethod
    def reduce(self, tensor: Tensor, dst: int, op: Any) -> Tensor:
        """Reduce ``tensor`` across processes into ``dst``'s tensor."""

    @abstractmethod
    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor) -> list[Tensor]:
        """Fill ``tensor_list`` with every process's ``tensor``."""

    @abstractmethod
    def gather(self, tensor: Tensor, gather_list: list[Tensor], dst: int = 0) -> list[Tensor]:
        """Fill ``dst``'s ``gather_list`` with every process's ``tensor``."""

    @abstractmethod
    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], src: int = 0) -> Tensor:
        """Give process i the i-th tensor of ``src``'s ``scatter_list``."""

    @abstractmethod
    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], op: Any) -> Tensor:
        """Reduce the i-th input of every process into process i's ``output``."""

    @abstractmethod
    def all_to_all(self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor]) -> list[Tensor]:
        """Send the i-th input to process i; receive process j's tensor into the j-th output."""

    @abstractmethod
    def send(self, tensor: Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to process ``dst``."""

    @abstractmethod
    def recv(self, tensor: Tensor, src: int | None = None, tag: int = 0) -> Tensor:
        """Receive into ``tensor`` from ``src`` (any process when None)."""

    @abstractmethod
    def barrier(self, device_ids: list[int] | None = None) -> None:
        """Wait until every process of the group arrives."""

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this kind of collective can work in this installation."""

    @classmethod
    @abstractmethod
    def is_initialized(cls) -> bool:
        """Whether the default group exists."""

    @classmethod
    @abstractmethod
    def init_group(cls, **kwargs: Any) -> None:
        """Create the default group."""

    @classmethod
    @abstractmethod
    def new_group(cls, **kwargs: Any) -> CollectibleGroup:
        """Create a group within the default one."""

    @classmethod
    @abstractmethod
    def destroy_group(cls, group: CollectibleGroup) -> None:
        """Destroy ``group``."""

    def setup(self, **kwargs: Any) -> Self:
        """Create the default group with ``kwargs`` unless it exists already."""
        if not self.is_initialized():
            self.init_group(**kwargs)
        return self

    def create_group(self, **kwargs: Any) -> Self:
        """Create this object's own group (within the default group, which must exist)."""
        if self._group is not None:
            raise RuntimeError(
                f"{type(self).__name__}.create_group(): this collective already owns a group. Call teardown() "
                "first, or create another collective."
            )
        self._group = self.new_group(**kwargs)
        return self

    def teardown(self) -> Self:
        """Destroy the group made by ``create_group``."""
        if self._group is None:
            raise RuntimeError(
                f"{type(self).__name__}.teardown(): this collective owns no group to destroy. Call it only after "
                "create_group()."
            )
        self.destroy_group(self._group)
        self._group = None
        return self
