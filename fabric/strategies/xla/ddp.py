"""XLAStrategy (`xla`): data parallel over XLA devices, one process each, gradients averaged in the optimizer step."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch
from torch.nn import Module

from fabric.accelerators.accelerator import Accelerator
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies.xla._parallel import XLAParallelStrategy


class XLAStrategy(XLAParallelStrategy):
    """Replicates the model in every process; `xm.optimizer_step` averages the gradients before each step.

    There is no DDP wrapper: backward computes local gradients only, and XLAPrecision's optimizer step all-reduces
    them (then runs the step and the pending graph). With `sync_module_states`, rank 0's weights are broadcast at
    setup so every replica starts equal.
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        sync_module_states: bool = True,
        start_method: str = "fork",
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            checkpoint_io=checkpoint_io,
            precision=precision,
            start_method=start_method,
        )
        self._sync_module_states = sync_module_states

    def setup_module(self, module: Module) -> Module:
        """Nothing to wrap; give every replica rank 0's weights."""
        if self._sync_module_states and self.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.broadcast_master_param(module)
        return module

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Backward never synchronises here (the optimizer step does), so there is nothing to skip."""
        return nullcontext()
