"""Base of the XLA strategies with one process per device: ranks from torch_xla, its launcher, its collectives."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.accelerators.accelerator import Accelerator
from fabric.checkpoint import state as _checkpoint
from fabric.environments.xla import XLAEnvironment
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies.launchers.xla import XLALauncher
from fabric.strategies.parallel import ParallelStrategy
from fabric.strategies.xla import _common

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


class XLAParallelStrategy(ParallelStrategy):
    """One process per XLA device, started by torch_xla; no torch.distributed process group is involved."""

    drives_xla = True
    _name = "xla"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        start_method: str = "fork",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=XLAEnvironment(),
            checkpoint_io=checkpoint_io,
            precision=precision,
            start_method=start_method,
        )
        _common.check_components(self._name, accelerator, precision)
        # Ranks and the device exist only inside the processes torch_xla starts; asking the runtime in the
        # launching process would start it there, and torch_xla then refuses to launch.
        self._launched = False
        self._moves = _common.ParameterMoves()

    def _connect(self, **components: Any) -> None:
        """Check that the connector's accelerator and precision are XLA's; the launcher is torch_xla's."""
        components["checkpoint_io"] = _common.default_checkpoint_io(components["checkpoint_io"])
        super()._connect(**components)
        _common.check_components(self._name, self._accelerator, self._precision)
        _refuse_several_cpu_devices(self._name, self.num_processes)

    def _make_launcher(self) -> XLALauncher:
        return XLALauncher(self.num_processes, start_method=self._start_method)

    def _precision_plugin(self, name: str, device_type: str) -> Precision | None:
        """XLAPrecision for every precision given by name."""
        from fabric.precision.xla import XLAPrecision

        return XLAPrecision(name)

    # -- who am I ---------------------------------------------------------------------------------
    @property
    def global_rank(self) -> int:
        """torch_xla's global ordinal (0 before the launch)."""
        return super().global_rank if self._launched else 0

    @property
    def local_rank(self) -> int:
        """torch_xla's ordinal on this host (0 before the launch)."""
        return super().local_rank if self._launched else 0

    @property
    def node_rank(self) -> int:
        """This host's index (0 before the launch)."""
        return super().node_rank if self._launched else 0

    @property
    def world_size(self) -> int:
        """All processes (before the launch: those this host will start)."""
        return super().world_size if self._launched else self.num_processes * self.num_nodes

    @property
    def root_device(self) -> torch.device:
        """The XLA device torch_xla gave this process."""
        if not self._launched:
            raise RuntimeError(
                f"{type(self).__name__}.root_device: each process's XLA device exists only inside the processes "
                "that fabric.launch() starts. Use the device inside the function you pass to fabric.launch()."
            )
        import torch_xla

        return torch_xla.device()

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward through the precision plugin; an autograd engine sized before XLA started is explained."""
        with _common.explain_early_backward():
            super().backward(tensor, module, *args, **kwargs)

    def setup_environment(self) -> None:
        """Mark this process as launched and select its device; torch_xla's runtime already connects the processes."""
        self._launched = True
        if self.accelerator is not None:
            self.accelerator.setup_device(self.root_device)

    def module_to_device(self, module: Module) -> None:
        """Move the module to this process's device, remembering which new parameters replaced the CPU ones."""
        self._moves.move(module, self.root_device)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Point an optimizer created before the move at the parameters on the device."""
        self._moves.update(optimizer)
        return optimizer

    # -- data and collectives ---------------------------------------------------------------------
    def process_dataloader(self, dataloader: DataLoader, *, even_batches: bool = True) -> DataLoader:
        """This process's shard of the data (a distributed sampler, unpadded if not even_batches), brought to the
        device by MpDeviceLoader."""
        sharded = super().process_dataloader(dataloader, even_batches=even_batches)
        return _common.device_loader(sharded, self.root_device)

    def barrier(self, name: str | None = None) -> None:
        """Every process meets at an XLA rendezvous (nothing to wait for before the launch)."""
        if self._launched:
            _common.barrier(name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send `obj` (a tensor, or any picklable object) from process `src` to all."""
        if not self._launched:
            return obj
        return _common.broadcast(obj, src, self.root_device, self.global_rank)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack the tensors of all processes along a new first dimension."""
        _common.check_group("all_gather", group)
        if not self._launched:
            return tensor
        return _common.all_gather(tensor, self.root_device, sync_grads)

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str = "mean") -> Tensor:
        """Reduce across processes ('mean', 'sum', 'max', 'min'); the input is left unchanged."""
        _common.check_group("all_reduce", group)
        if not self._launched:
            from fabric.utilities.distributed import check_reduce_op

            check_reduce_op(reduce_op)
            return tensor
        return _common.all_reduce(tensor, reduce_op, self.root_device, self.world_size)

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Every process runs its pending graph (so no collective is left half-done); rank 0 writes CPU tensors."""
        import torch_xla

        from fabric.io.xla import xla_state_to_cpu

        torch_xla.sync()
        converted = _checkpoint.convert_state(state, self.get_module_state_dict, self.get_optimizer_state, filter)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(xla_state_to_cpu(converted), path, storage_options=storage_options)


def _refuse_several_cpu_devices(name: str, num_processes: int) -> None:
    """torch_xla's CPU devices cannot run a collective between replicas: say so instead of an abort at the first."""
    from fabric.accelerators.xla import pjrt_device

    if num_processes > 1 and pjrt_device() == "CPU":
        raise RuntimeError(
            f"Fabric(strategy={name!r}, devices={num_processes}) with PJRT_DEVICE=CPU: torch_xla cannot run "
            "collectives between several CPU devices (its replicas abort at the first all_reduce, pytorch/xla#9496). "
            "Use devices=1 to test on the CPU, or run on a TPU."
        )
