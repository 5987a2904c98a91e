"""`dp`: torch.nn.DataParallel, one process that replicates the module over its GPUs and splits each batch."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.nn import DataParallel, Module

from fabric.accelerators.accelerator import Accelerator
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies._one_process import OneProcessStrategy
from fabric.utilities.exceptions import FabricValueError


class DataParallelStrategy(OneProcessStrategy):
    """One process; `fabric.setup` wraps the model in DataParallel, which scatters every batch over the devices.

    There is one rank, so barrier, broadcast and all_gather are identities. all_reduce reduces over the elements
    of the tensor: values computed per replica come back from DataParallel stacked along dimension 0.
    """

    repeatable_module_setup = True  # DataParallel wraps the module without changing it

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        self.parallel_devices = parallel_devices

    def _connect(self, *, parallel_devices: list[torch.device], num_nodes: int, **components: Any) -> None:
        """Take the connector's devices; DataParallel cannot span machines or several CPU devices."""
        super()._connect(parallel_devices=parallel_devices, num_nodes=num_nodes, **components)
        self.parallel_devices = self.parallel_devices or parallel_devices
        if num_nodes > 1:
            raise FabricValueError(
                f"Fabric(strategy='dp', num_nodes={num_nodes}): DataParallel runs in one process on one machine. "
                "Use strategy='ddp' to train on several machines."
            )
        devices = self.parallel_devices
        if devices[0].type == "cpu" and len(devices) > 1:
            raise FabricValueError(
                f"Fabric(strategy='dp', accelerator='cpu', devices={len(devices)}): DataParallel replicates the "
                "model over GPUs only. Use devices=1 (one CPU device), or strategy='ddp' for several CPU processes."
            )

    @property
    def root_device(self) -> torch.device:
        """The first device: the module lives there, DataParallel gathers the outputs there."""
        return self.parallel_devices[0] if self.parallel_devices else torch.device("cpu")

    def setup_module(self, module: Module) -> Module:
        """Wrap in DataParallel over the devices; on the one CPU device there is nothing to replicate."""
        if self.root_device.type == "cpu":
            # DataParallel on CPU would either do nothing or, on a machine with GPUs, scatter to them anyway.
            return module
        return DataParallel(module, device_ids=self.parallel_devices, output_device=self.root_device)

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str = "mean") -> Tensor:
        """Reduce over the tensor's elements, in its dtype (a mean is computed in float32)."""
        from fabric.utilities.distributed import check_reduce_op

        if not isinstance(tensor, Tensor):
            return tensor
        op = check_reduce_op(reduce_op)
        if op == "mean":
            return tensor.float().mean().to(tensor.dtype)
        if op == "sum":
            return tensor.sum()
        return tensor.max() if op == "max" else tensor.min()

    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The user's module's state, without DataParallel's `module.` prefix."""
        return (module.module if isinstance(module, DataParallel) else module).state_dict()
