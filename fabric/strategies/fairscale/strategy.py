"""`ddp_sharded`: fairscale's sharded optimizer (OSS) with ShardedDataParallel, a legacy ZeRO-2-style strategy.

fairscale is imported when the strategy is created, never by `import fabric`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.accelerators.accelerator import Accelerator
from fabric.checkpoint import state as _checkpoint
from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies.ddp import DDPStrategy
from fabric.strategies.fairscale import _sharded
from fabric.strategies.parallel import DEFAULT_TIMEOUT
from fabric.utilities.exceptions import FabricTypeError
from fabric.utilities.rank_zero import WarningCache

if TYPE_CHECKING:
    from fairscale.nn.data_parallel import ShardedDataParallel

# Lightning's choice: one bucket of 8M elements only across nodes, where fewer, larger messages pay off.
_MULTI_NODE_REDUCE_BUFFER_SIZE = 2**23
_warnings = WarningCache()
_UNMAINTAINED = (
    "Strategy 'ddp_sharded' runs on fairscale, which is no longer maintained (its last release is 0.4.13). "
    "fabric keeps it for existing code; for new code use strategy='fsdp' (torch's FSDP2, which shards "
    "parameters too) or 'deepspeed'."
)


class DDPShardedStrategy(DDPStrategy):
    """Shards optimizer state (fairscale's OSS); ShardedDataParallel reduces each gradient to the rank owning it.

    Model and optimizers are set up together: `model, optimizer = fabric.setup(model, optimizer)` turns the optimizer
    into an OSS of the same class and wraps the model. Keyword arguments go to ShardedDataParallel (for example
    `reduce_buffer_size`, `broadcast_buffers`); `start_method` picks the launcher as for DDP.
    """

    repeatable_module_setup = False  # ShardedDataParallel and OSS are built around one model and its optimizers

    requires_joint_setup = True

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        num_nodes: int = 1,
        **sharded_ddp_kwargs: Any,
    ) -> None:
        _sharded.import_fairscale(f"{type(self).__name__}()")
        _sharded.check_sharded_ddp_kwargs(sharded_ddp_kwargs)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,
            num_nodes=num_nodes,
            **sharded_ddp_kwargs,
        )
        # A list, not a WeakSet: ddp_sharded_spawn pickles the strategy into its processes, and a WeakSet cannot be.
        self._sharded_modules: list[ShardedDataParallel] = []
        _warnings.warn(_UNMAINTAINED, category=UserWarning)

    def _connect(self, **components: Any) -> None:
        """Connect as DDP does; a float16 loss scaler must agree across the shards."""
        super()._connect(**components)
        _check_scaler(self.precision)

    def _precision_plugin(self, name: str, device_type: str) -> Precision | None:
        """`16-mixed` on a GPU scales the loss with a sharded scaler: each rank sees inf/nan only in its own shard."""
        if name != "16-mixed" or device_type == "cpu":
            return None
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        from fabric.precision.amp import MixedPrecision

        return MixedPrecision("16-mixed", device=device_type, scaler=ShardedGradScaler(device_type))

    # -- setup --------------------------------------------------------------------------------------
    def setup_module_and_optimizers(
        self, module: Module, optimizers: Iterable[Optimizer]
    ) -> tuple[Module, list[Optimizer]]:
        """Turn each optimizer into an OSS over its shard and wrap the model in ShardedDataParallel."""
        from fairscale.nn.data_parallel import ShardedDataParallel

        optimizers = list(optimizers)
        if not optimizers:
            raise RuntimeError(_joint_setup_message(f"fabric.setup({type(module).__name__}) without an optimizer"))
        _sharded.reject_fairscale_fsdp(module)
        for optimizer in optimizers:
            _sharded.check_optimizer_fits(module, optimizer)
        # float16 copies of the updated shards halve the broadcast between nodes; AMP's float32 master weights make
        # that harmless (Lightning's rule). Within one node the exact float32 broadcast costs little.
        broadcast_fp16 = self.precision.precision in ("16-mixed", "16-true") and self.num_nodes > 1
        sharded = [_sharded.to_oss(optimizer, broadcast_fp16) for optimizer in optimizers]
        kwargs = dict(self._ddp_kwargs)
        kwargs.setdefault("reduce_buffer_size", _MULTI_NODE_REDUCE_BUFFER_SIZE if self.num_nodes > 1 else 0)
        wrapped = ShardedDataParallel(module, sharded_optimizer=sharded, **kwargs)
        # Also before forward: a script that calls loss.backward() itself still reduces this step's gradients.
        wrapped.register_forward_pre_hook(lambda sdp, _: _sharded.reattach_bucket_grads(sdp))
        self._sharded_modules.append(wrapped)
        return wrapped, list(sharded)

    def setup_module(self, module: Module) -> Any:
        """Not possible: ShardedDataParallel reduces each gradient to the rank whose OSS shard owns it."""
        raise RuntimeError(_joint_setup_message(f"fabric.setup_module({type(module).__name__})"))

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Never called by Fabric (requires_joint_setup); explains the joint call to direct callers."""
        raise RuntimeError(
            "DDPShardedStrategy.setup_optimizer(): the sharded optimizer must be set up with its model. Call "
            "model, optimizer = fabric.setup(model, optimizer)."
        )

    # -- training step ------------------------------------------------------------------------------
    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward into the gradient buckets, whatever zero_grad(set_to_none=...) did since the last step."""
        for sharded in self._sharded_modules:
            _sharded.reattach_bucket_grads(sharded)
        super().backward(tensor, module, *args, **kwargs)

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """ShardedDataParallel's no_sync: gradients accumulate locally until the next synced backward."""
        from fairscale.nn.data_parallel import ShardedDataParallel

        if not enabled:
            return nullcontext()
        if not isinstance(module, ShardedDataParallel):
            raise FabricTypeError(
                f"no_backward_sync({type(module).__name__}): gradient sync can only be skipped for a model "
                "returned by fabric.setup(model, optimizer). Pass that model."
            )
        return module.no_sync()

    def clip_gradients_norm(
        self, module: Module, optimizer: Optimizer, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> Tensor:
        """Clip by the norm of all gradients, summed over the shards (OSS.clip_grad_norm); returns that norm."""
        sharded = _sharded.require_oss(optimizer, "fabric.clip_gradients(max_norm=...)")
        self.precision.unscale_gradients(optimizer)
        # OSS caches the owned parameters that have a gradient at its first clip; a parameter unused then would be
        # left out of every later norm. Drop the cache so each clip sees this step's gradients.
        sharded._OSS__local_params = None
        norm = sharded.clip_grad_norm(max_norm, norm_type)
        if error_if_nonfinite and not self.precision.has_loss_scaler and not torch.isfinite(norm):
            raise RuntimeError(
                f"fabric.clip_gradients(max_norm={max_norm}, norm_type={norm_type}): the total gradient norm is "
                f"{norm.item()}, so the gradients cannot be clipped. Find where the loss or gradients become "
                "inf/nan, or pass error_if_nonfinite=False to go on anyway."
            )
        return norm

    # -- checkpoints --------------------------------------------------------------------------------
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole optimizer state, gathered from every shard onto every rank; collective (call it on all ranks)."""
        from fairscale.optim import OSS

        if isinstance(optimizer, OSS):
            return _sharded.gathered_state(optimizer)
        return optimizer.state_dict()

    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Rank 0 gathers every optimizer shard (OSS.consolidate_state_dict) and writes one plain checkpoint.

        The file loads like a DDP checkpoint: into a plain optimizer in one process, or into `ddp_sharded` on any
        number of processes (each keeps its shard).
        """
        rank = self.global_rank
        converted = _checkpoint.convert_state(
            state, self.get_module_state_dict, lambda opt: _optimizer_for_file(opt, rank), filter
        )
        if self.is_global_zero:
            self.checkpoint_io.save_checkpoint(converted, path, storage_options=storage_options)

    def teardown(self) -> None:
        """Forget the wrapped models, then leave the process group as DDP does."""
        self._sharded_modules.clear()
        super().teardown()


def _joint_setup_message(call: str) -> str:
    return (
        f"{call} with strategy 'ddp_sharded': fairscale's ShardedDataParallel needs the sharded optimizer to know "
        "which rank owns which gradient. Call model, optimizer = fabric.setup(model, optimizer); for a model "
        "without optimizer (inference), use strategy='ddp'."
    )


def _optimizer_for_file(optimizer: Optimizer, rank: int) -> dict[str, Any]:
    from fairscale.optim import OSS

    if isinstance(optimizer, OSS):
        return _sharded.consolidated_state(optimizer, rank)
    return optimizer.state_dict()


def _check_scaler(precision: Precision) -> None:
    """A plain GradScaler decides per rank whether to step; ranks that disagree hang in OSS's broadcast."""
    scaler = getattr(precision, "scaler", None)
    if scaler is None:
        return
    from fairscale.optim.grad_scaler import ShardedGradScaler as FairscaleScaler
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    if not isinstance(scaler, (ShardedGradScaler, FairscaleScaler)):
        raise FabricTypeError(
            f"Fabric(strategy='ddp_sharded', plugins=[{type(precision).__name__}(scaler={type(scaler).__name__})]): "
            "each rank sees only its own shard's gradients, so a plain GradScaler can skip the step on one rank "
            "and not on another, and the ranks then wait for each other forever. Pass "
            "scaler=torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler(), which agrees across ranks, "
            "or leave the plugin out."
        )
