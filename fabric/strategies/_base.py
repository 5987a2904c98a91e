"""Behaviour every strategy shares: holding its components, backward, steps, clipping, checkpoints."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint import state as _checkpoint
from fabric.health.preemption import Preemption

if TYPE_CHECKING:
    from fabric.accelerators.accelerator import Accelerator
    from fabric.environments.cluster_environment import ClusterEnvironment
    from fabric.io.checkpoint_io import CheckpointIO
    from fabric.precision.precision import Precision
    from fabric.strategies.launchers.launcher import Launcher


class _StrategyComponents:
    """Owns the components below the strategy and implements what does not depend on distribution."""

    # Set True by strategies whose processes must be created or joined by `Fabric.launch()`.
    requires_launch: bool = False
    # Set True by strategies that must see model and optimizers together (DeepSpeed).
    requires_joint_setup: bool = False
    # Set True by strategies whose setup_module leaves the user's module as it is (it returns it, or a wrapper such as
    # DDP's): setting the same module up again then gives a second correct wrapper (Fabric warns). Sharding and
    # engine strategies change the module itself, so a second setup is refused.
    repeatable_module_setup: bool = False
    # Set True by strategies that drive XLA devices (torch_xla's step, loader and collectives): the only ones
    # accelerator='xla' accepts, since a strategy made for CUDA or the CPU would silently skip torch_xla's steps.
    drives_xla: bool = False

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        self._accelerator = accelerator
        self._checkpoint_io = checkpoint_io
        self._precision = precision
        self._launcher: Launcher | None = None

    # -- components -------------------------------------------------------------------------------
    @property
    def accelerator(self) -> Accelerator | None:
        """The hardware."""
        return self._accelerator

    @property
    def precision(self) -> Precision:
        """The numeric policy (32-true until connected)."""
        if self._precision is None:
            from fabric.precision.precision import Precision

            self._precision = Precision()
        return self._precision

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """How checkpoints reach storage."""
        if self._checkpoint_io is None:
            from fabric.io.torch_io import TorchCheckpointIO

            self._checkpoint_io = TorchCheckpointIO()
        return self._checkpoint_io

    @property
    def launcher(self) -> Launcher | None:
        """How the processes come to exist, or None when they already do."""
        return self._launcher

    @property
    def cluster_environment(self) -> ClusterEnvironment | None:
        """Who this process is in the job; single-device strategies have none."""
        return None

    @property
    def preemption(self) -> Preemption:
        """Whether the job was preempted, decided the same on every rank (`fabric.preempted`)."""
        # Created on first use: subclasses need not call this class's __init__ for it to exist.
        if getattr(self, "_preemption", None) is None:
            self._preemption = Preemption()
        return self._preemption

    def _connect(
        self,
        *,
        accelerator: Accelerator,
        precision: Precision,
        checkpoint_io: CheckpointIO,
        cluster_environment: ClusterEnvironment,
        parallel_devices: list[torch.device],
        num_nodes: int,
    ) -> None:
        """Called once by the connector: fill in what the user did not give, then build the launcher."""
        self._accelerator = self._accelerator or accelerator
        self._precision = self._precision or precision
        self._checkpoint_io = self._checkpoint_io or checkpoint_io

    def _precision_plugin(self, name: str, device_type: str) -> Precision | None:
        """The plugin this strategy needs for a precision given by name (DeepSpeed's); None: the usual one."""
        return None

    # -- properties every strategy derives the same way -------------------------------------------
    @property
    def is_global_zero(self) -> bool:
        """Whether this is the process with global rank 0."""
        return self.global_rank == 0  # type: ignore[attr-defined]

    # -- model placement and steps ------------------------------------------------------------------
    def module_to_device(self, module: Module) -> None:
        """Move the module's parameters and buffers to this process's device."""
        module.to(self.root_device)  # type: ignore[attr-defined]

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Create modules on the device, in the precision's dtype, optionally skipping initialisation."""
        from fabric.utilities.init import _EmptyInit

        stack = ExitStack()
        stack.enter_context(torch.device(self.root_device))  # type: ignore[attr-defined]
        stack.enter_context(_EmptyInit(enabled=bool(empty_init)))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def tensor_init_context(self) -> AbstractContextManager:
        """Create tensors on the device in the precision's dtype."""
        stack = ExitStack()
        stack.enter_context(torch.device(self.root_device))  # type: ignore[attr-defined]
        stack.enter_context(self.precision.tensor_init_context())
        return stack

    def _runs_base(self, method: str) -> bool:
        """Whether this strategy's `method` ("backward" or "optimizer_step") and its precision plugin's are the
        base ones, which only call torch's own: the caller may then call torch directly, every step."""
        from fabric.precision.precision import Precision

        precision = self._precision or self.precision
        base = getattr(_StrategyComponents, method), getattr(Precision, method)
        return (getattr(type(self), method), getattr(type(precision), method)) == base

    def _fast_backward(self) -> tuple[bool, Any]:
        """Whether `Fabric.backward` may call torch's backward itself, and the object counting the backward passes
        it runs so (`.backwards += 1` before each; None: nothing counts). Asked at the first backward, once the
        processes and their group exist."""
        return self._runs_base("backward"), None

    def _backward_failed(self, err: RuntimeError, counter: Any) -> None:
        """Explain `err`, raised by a backward that `Fabric.backward` ran itself (see `_fast_backward`)."""

    # These two run every step: the plugin is read from its slot (set once connected), not through the property.
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward through the precision plugin."""
        (self._precision or self.precision).backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step through the precision plugin."""
        return (self._precision or self.precision).optimizer_step(optimizer, **kwargs)

    def clip_gradients_norm(
        self,
        module: Module,
        optimizer: Optimizer,
        max_norm: float,
        norm_type: float,
        error_if_nonfinite: bool,
    ) -> Tensor:
        """Clip the gradient norm of the optimizer's parameters; returns the norm before clipping."""
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # With a loss scaler, inf/nan gradients are expected: the scaler skips that step.
        check = error_if_nonfinite and not self.precision.has_loss_scaler
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type, error_if_nonfinite=check)

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float) -> None:
        """Clamp each gradient element to [-clip_val, clip_val]."""
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_value_(params, clip_val)

    def pipeline_step(self, module: Module, inputs: tuple[Any, ...], target: Any) -> Tensor:
        """Forward and backward over microbatches on every stage; only pipeline strategies run one."""
        from fabric.utilities.exceptions import FabricTypeError

        raise FabricTypeError(
            f"fabric.pipeline_step(model, ...) under {type(self).__name__}: this strategy runs the whole model in "
            "each process, so there is no pipeline to step. Use strategy=PipelineStrategy(split_points=[...], "
            "loss_fn=...), or compute loss = loss_fn(model(x), y) and call fabric.backward(loss)."
        )

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """True if all (or any) processes decided True."""
        value = torch.tensor(int(decision), device=self.root_device)  # type: ignore[attr-defined]
        total = self.all_reduce(value, reduce_op="sum")  # type: ignore[attr-defined]
        return bool(total == self.world_size) if all else bool(total > 0)  # type: ignore[attr-defined]

    # -- checkpoints --------------------------------------------------------------------------------
    def _reserve_async_save_memory(self, module: Module, optimizers: list[Optimizer]) -> None:
        """With AsyncCheckpointIO, fault in the first save's buffers in the background after the first step.

        Only where this process saves the live tensors (rank 0 of this class's single-file save); strategies
        that gather or shard the state save other tensors. Synchronous saves get nothing added.
        """
        io = self._checkpoint_io
        reserve = getattr(io, "reserve_after_first_step", None)
        own = (_StrategyComponents.save_checkpoint, _StrategyComponents.get_module_state_dict,
               _StrategyComponents.get_optimizer_state)  # fmt: skip
        methods = (type(self).save_checkpoint, type(self).get_module_state_dict, type(self).get_optimizer_state)
        if reserve is not None and methods == own and self.is_global_zero:
            reserve(module, optimizers)

    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """The full state dict of a module."""
        return module.state_dict()

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The full state dict of an optimizer."""
        return optimizer.state_dict()

    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Rank 0 writes the converted state; the others wait at the barrier the Fabric calls after."""
        converted = _checkpoint.convert_state(state, self.get_module_state_dict, self.get_optimizer_state, filter)
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(converted, path, storage_options=storage_options)

    def load_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any] | Module | Optimizer | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Every process reads the file and restores `state` in place; returns what was not consumed.

        A sharded checkpoint directory (written by FSDP or model-parallel processes, on any number of them) is
        read through torch.distributed.checkpoint, which gathers the shards this process needs. A DeepSpeed
        checkpoint directory gives its consolidated model weights and other entries, not its optimizer state.
        Unless `weights_only` is False, nothing that could run code is unpickled.
        """
        from fabric.checkpoint import sharded as _sharded_checkpoint
        from fabric.io._load import DeviceRecorder
        from fabric.strategies.deepspeed import checkpoint as _deepspeed_checkpoint

        if _sharded_checkpoint.is_sharded_checkpoint(path):
            return _sharded_checkpoint.load(path, state, strict, weights_only)
        _refuse_xla_fsdp_shards(path)
        recorder = DeviceRecorder(self.root_device)  # type: ignore[attr-defined]
        if _deepspeed_checkpoint.is_deepspeed_checkpoint(path):
            # Model weights and the other entries; ZeRO's flat optimizer shards fit no plain optimizer.
            checkpoint = _deepspeed_checkpoint.consolidate_deepspeed(path, weights_only, op="load")
        else:
            # Everything lands on CPU first; only plain tensors go back to their device (see place_plain).
            checkpoint = self.checkpoint_io.load_checkpoint(path, map_location=recorder, weights_only=weights_only)
        checkpoint = _checkpoint.place_plain(checkpoint, state, recorder.restore)
        if state is None:
            return checkpoint
        if isinstance(state, (Module, Optimizer)):
            _checkpoint.load_raw_into(state, checkpoint, strict, str(path))
            return {}
        return _checkpoint.restore_state(state, checkpoint, strict, str(path))

    def wait_for_checkpoints(self) -> None:
        """Block until background saves are complete on every process; raise the error of one that failed.

        With an asynchronous CheckpointIO this is collective: only rank 0 writes single files, so the other
        processes must also wait for it before they read, and learn whether it failed (every rank raises).
        """
        io = self._checkpoint_io  # None: no checkpoint IO was made yet, so nothing can be in flight
        if io is None or not io.asynchronous:
            if io is not None:
                io.wait()
            return
        from fabric.checkpoint.async_saver import wait_on_every_rank

        me: Any = self
        wait_on_every_rank(
            self.checkpoint_io, me.global_rank, me.world_size, me.all_reduce, me.broadcast, me.root_device
        )

    def teardown(self) -> None:
        """Release everything this strategy set up."""
        self.preemption.detach()
        self.precision.teardown()
        if self._accelerator is not None:
            self._accelerator.teardown()
        self.checkpoint_io.teardown()


def _refuse_xla_fsdp_shards(path: str | Path) -> None:
    """xla_fsdp's per-process shards fit only an xla_fsdp model on as many processes; say how to read them here."""
    from fabric.checkpoint.xla_fsdp import is_xla_fsdp_checkpoint
    from fabric.utilities.exceptions import FabricValueError

    if is_xla_fsdp_checkpoint(path):
        raise FabricValueError(
            f"load({str(path)!r}): this is a sharded xla_fsdp checkpoint (one file per process), which only "
            "strategy='xla_fsdp' with the same number of processes loads. Merge it into one file of full weights "
            "first: fabric.strategies.xla.consolidate_xla_fsdp_checkpoint(path, 'full.ckpt'), then load that."
        )
