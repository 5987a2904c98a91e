"""SingleDeviceCollective: the Collective role for one process, where every operation returns its input."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from fabric.collectives.collective import Collective
from fabric.utilities.types import CollectibleGroup


class _OneProcessGroup:
    """The group of a single process: size 1, rank 0."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


class SingleDeviceCollective(Collective):
    """Collectives among one process: results are what this process alone would contribute."""

    @property
    def rank(self) -> int:
        """Always 0."""
        return 0

    @property
    def world_size(self) -> int:
        """Always 1."""
        return 1

    def broadcast(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        """``tensor`` itself."""
        return tensor

    def all_reduce(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        """``tensor`` itself."""
        return tensor

    def reduce(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        """``tensor`` itself."""
        return tensor

    def all_gather(self, tensor_list: list[Tensor], tensor: Tensor, **__: Any) -> list[Tensor]:
        """``[tensor]``."""
        return [tensor]

    def gather(self, tensor: Tensor, *_: Any, **__: Any) -> list[Tensor]:
        """``[tensor]``."""
        return [tensor]

    def scatter(self, tensor: Tensor, scatter_list: list[Tensor], *_: Any, **__: Any) -> Tensor:
        """The first (only) tensor of ``scatter_list``."""
        return scatter_list[0]

    def reduce_scatter(self, output: Tensor, input_list: list[Tensor], *_: Any, **__: Any) -> Tensor:
        """The first (only) input."""
        return input_list[0]

    def all_to_all(
        self, output_tensor_list: list[Tensor], input_tensor_list: list[Tensor], *_: Any, **__: Any
    ) -> list[Tensor]:
        """The inputs, as this process sends them to itself."""
        return input_tensor_list

    def send(self, *_: Any, **__: Any) -> None:
        """Nothing to send to."""

    def recv(self, tensor: Tensor, *_: Any, **__: Any) -> Tensor:
        """``tensor`` unchanged."""
        return tensor

    def barrier(self, *_: Any, **__: Any) -> None:
        """Nothing to wait for."""

    @classmethod
    def is_available(cls) -> bool:
        """Always."""
        return True

    @classmethod
    def is_initialized(cls) -> bool:
        """Always."""
        return True

    @classmethod
    def init_group(cls, **_: Any) -> None:
        """Nothing to create."""

    @classmethod
    def new_group(cls, **_: Any) -> CollectibleGroup:
        """A group of this one process."""
        return _OneProcessGroup()

    @classmethod
    def destroy_group(cls, group: CollectibleGroup) -> None:
        """Nothing to destroy."""
