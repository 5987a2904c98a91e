"""The loader xla_spmd's `process_dataloader` returns: every batch lands on the XLA device split along the mesh's
batch axes, so each device reads its slice of the batch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import Tensor

from fabric.strategies.xla.spmd_mesh import batch_spec
from fabric.utilities.apply_func import apply_to_collection

if TYPE_CHECKING:
    from torch.utils.data import DataLoader
    from torch_xla.distributed.spmd import Mesh


def shard_batch(batch: Any, mesh: Mesh, device: torch.device) -> Any:
    """Every tensor in `batch` on `device`, dimension 0 split along the mesh's batch axes (0-d tensors whole)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    names = tuple(mesh.axis_names or ())

    def place(tensor: Tensor) -> Tensor:
        spec = batch_spec(names, tensor.dim())
        # From host memory, each device receives only its slice. torch_xla 2.9's ShardingSpec fails on a 1-D
        # tensor over a mesh of several axes (IndexError), so such tensors (labels, mostly) are moved whole and
        # then annotated: XLA splits them when the step's program runs.
        if spec is not None and tensor.device.type == "cpu" and (tensor.dim() > 1 or len(names) == 1):
            placed = xm.send_cpu_data_to_device([tensor], device, xs.ShardingSpec(mesh, spec))
            return cast(list[Tensor], placed)[0]
        moved = tensor.to(device)
        if spec is not None:
            xs.mark_sharding(moved, mesh, spec)
        return moved

    return apply_to_collection(batch, Tensor, place)


class SpmdDataLoader:
    """Iterates a DataLoader (read whole, by this one process) and yields its batches sharded over the mesh.

    Attributes it does not have (`dataset`, `sampler`, `batch_size`, ...) are the wrapped loader's.
    """

    def __init__(self, dataloader: DataLoader, mesh: Mesh, device: torch.device) -> None:
        self._dataloader = dataloader
        self._mesh = mesh
        self._device = device

    @property
    def dataloader(self) -> DataLoader:
        """The wrapped DataLoader."""
        return self._dataloader

    def __len__(self) -> int:
        return len(self._dataloader)

    def __iter__(self) -> Iterator[Any]:
        for batch in self._dataloader:
            yield shard_batch(batch, self._mesh, self._device)

    def __getattr__(self, name: str) -> Any:
        # Only reached for attributes this wrapper lacks; while unpickling `_dataloader` is not set yet.
        dataloader = self.__dict__.get("_dataloader")
        if dataloader is None:
            raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")
        return getattr(dataloader, name)
