"""DeepSpeed ZeRO (stages 1-3, CPU/NVMe offload): one engine drives model, optimizer, backward and step.

`import deepspeed` happens in `setup_environment`, i.e. only when a Fabric with this strategy launches.
"""

from __future__ import annotations

import atexit
import copy
import gc
import logging
import os
import weakref
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.accelerators.accelerator import Accelerator
from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies.deepspeed import config as cfg
from fabric.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine

    from fabric.precision.deepspeed import DeepSpeedPrecision


class DeepSpeedStrategy(ParallelStrategy):
    """Shards optimizer state (stage 1), gradients (2) and parameters (3) across processes with DeepSpeed ZeRO.

    Pass a DeepSpeed `config` (dict or JSON path), Lightning-style keywords, or both: a keyword fills in what the
    config lacks, and a keyword that contradicts the config is an error. Without a config, unset keywords take
    Lightning's defaults (stage 2, untested optimizers allowed).
    """

    requires_joint_setup = True

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        zero_optimization: bool | None = None,
        stage: int | None = None,
        remote_device: str | None = None,
        offload_optimizer: bool | None = None,
        offload_parameters: bool | None = None,
        config: str | Path | dict[str, Any] | None = None,
        logging_level: int = logging.WARN,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = DEFAULT_TIMEOUT,
        start_method: str = "popen",
        num_nodes: int = 1,
        exclude_frozen_parameters: bool = False,
        **keywords: Any,
    ) -> None:
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
        )
        unknown = sorted(set(keywords) - set(cfg.ALL_KEYWORDS))
        if unknown:
            raise FabricTypeError(
                f"DeepSpeedStrategy({unknown[0]}=...): unknown keyword. Known ones: "
                f"{', '.join(sorted(cfg.ALL_KEYWORDS))}; anything else goes in config=."
            )
        user_config = cfg.read_config(config)
        self._keywords = keywords
        self._uses_defaults = user_config is None
        self.config = cfg.build_config(
            user_config, zero_optimization, stage, offload_optimizer, offload_parameters, keywords
        )
        self.remote_device = remote_device
        self.logging_level = logging_level
        self.exclude_frozen_parameters = exclude_frozen_parameters
        self._engine: DeepSpeedEngine | None = None
        self._clip_pending = False

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage in use (0 = plain data parallel)."""
        return cfg.zero_stage(self.config)

    @property
    def _forward_is_collective(self) -> bool:
        return self.zero_stage == 3  # stage 3 gathers the partitioned parameters in every forward

    @property
    def engine(self) -> DeepSpeedEngine | None:
        """The DeepSpeed engine built by fabric.setup (None before)."""
        return self._engine

    def _precision_plugin(self, name: str, device_type: str) -> Precision | None:
        """A precision name becomes a DeepSpeedPrecision: DeepSpeed casts the model and scales the loss itself."""
        from fabric.precision.deepspeed import DeepSpeedPrecision

        return DeepSpeedPrecision(name)  # type: ignore[arg-type]

    def _connect(self, **components: Any) -> None:
        """Fill in the components, then turn the precision into DeepSpeed's fp16/bf16 section."""
        super()._connect(**components)
        if self.checkpoint_io.asynchronous:
            raise FabricValueError(
                f"DeepSpeedStrategy with plugins=[{type(self.checkpoint_io).__name__}(...)]: DeepSpeed writes its "
                "checkpoints itself, without a CheckpointIO, so they cannot be saved in the background. Remove the "
                "plugin, or use strategy='fsdp', whose sharded saves it makes asynchronous."
            )
        precision = _check_precision_plugin(self.precision)
        cfg.apply_precision(self.config, precision.precision)
        cfg.apply_fp16_keywords(self.config, self._keywords, self._uses_defaults)
        cfg.check_device_indices(self.parallel_devices or [])

    # -- process group ------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Join the process group as DDP does, then hand it to deepspeed.comm."""
        super().setup_environment()
        import deepspeed
        from deepspeed.accelerator import get_accelerator

        deepspeed.utils.logging.logger.setLevel(self.logging_level)
        ds_accelerator = get_accelerator()
        ds_device = ds_accelerator.device_name()
        if ds_device != self.root_device.type:
            raise RuntimeError(
                f"DeepSpeedStrategy on device {self.root_device}: DeepSpeed selected its {ds_device!r} accelerator. "
                f"Set the environment variable DS_ACCELERATOR={self.root_device.type} before starting, or choose "
                f"Fabric(accelerator={ds_device!r})."
            )
        cfg.check_dtype_supported(self.precision.precision, ds_accelerator)
        # DeepSpeed's engine reads LOCAL_RANK from the environment; our own launcher leaves it unset in the process
        # it runs as local rank 0 (and for devices=1). Setting it also tells later Fabric objects in this process
        # that the processes already exist, which is true from here on.
        os.environ.setdefault("LOCAL_RANK", str(self.local_rank))
        deepspeed.init_distributed(
            dist_backend=self.process_group_backend,
            auto_mpi_discovery=False,
            dist_init_required=False,
            timeout=self._timeout,
        )
        if self._owns_process_group:
            # Registered after the group's own exit hook, so it runs first (atexit is last-in, first-out). A script
            # that never tears down leaves the engine (cycles holding the group) and DeepSpeed's cached groups
            # alive; gloo's threads then die in interpreter finalisation and abort the rank ("terminate called
            # without an active exception"), as the group hook alone cannot free them.
            atexit.register(_release_at_exit, weakref.ref(self))

    def teardown(self) -> None:
        """Release the engine, then the process group."""
        if self._engine is not None:
            self._engine.destroy()
            self._engine = None
        destroys_group = self._owns_process_group
        super().teardown()
        if destroys_group:
            _forget_deepspeed_groups()

    # -- setup --------------------------------------------------------------------------------------
    def setup_module_and_optimizers(
        self, module: Module, optimizers: Iterable[Optimizer]
    ) -> tuple[Module, list[Optimizer]]:
        """Build one DeepSpeed engine from the model and its optimizer; no optimizer gives an inference engine."""
        optimizers = list(optimizers)
        if len(optimizers) > 1:
            raise FabricValueError(
                f"fabric.setup(model, {len(optimizers)} optimizers): DeepSpeed drives exactly one optimizer. "
                "Combine the parameter groups into one optimizer, or use strategy='ddp' or 'fsdp'."
            )
        if not optimizers:
            return self.setup_module(module), []
        self._engine = self._initialize(module, optimizers[0])
        # The user's optimizer is returned: DeepSpeed has swapped its param_groups for the flat float32 shards
        # it steps, and LR schedulers see the same groups. Its step() is routed to engine.step().
        return self._engine, [optimizers[0]]

    def setup_module(self, module: Module) -> Module:
        """An engine without optimizer, for inference: stage 3 still shards the parameters.

        Stages 1 and 2 shard only optimizer state and gradients, which inference does not have, and DeepSpeed
        refuses them without an optimizer; the model is then set up without ZeRO (replicated, as in DDP).
        """
        config = self.config
        if 0 < self.zero_stage < 3:
            config = copy.deepcopy(config)
            config["zero_optimization"] = {"stage": 0}
        self._engine = self._initialize(module, None, config)
        return self._engine

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Never called by Fabric (requires_joint_setup); explains the joint call to direct callers."""
        raise RuntimeError(
            "DeepSpeedStrategy.setup_optimizer(): DeepSpeed must see the model and its optimizer together. "
            "Call model, optimizer = fabric.setup(model, optimizer)."
        )

    def _initialize(
        self, module: Module, optimizer: Optimizer | None, config: dict[str, Any] | None = None
    ) -> DeepSpeedEngine:
        import deepspeed

        if optimizer is not None:
            _check_optimizer_fits(module, optimizer)
        with self._collective("setup"):  # DeepSpeed broadcasts rank 0's weights and builds its groups
            engine, _, _, _ = deepspeed.initialize(
                model=module, optimizer=optimizer, config=config or self.config, dist_init_required=False
            )
        return engine

    def module_to_device(self, module: Module) -> None:
        """Stage-3 parameters created under init_module are partitioned already; DeepSpeed places them."""
        if any(hasattr(param, "ds_id") for param in module.parameters()):
            return
        super().module_to_device(module)

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """For stage 3, create the model already partitioned (deepspeed.zero.Init), so no rank holds all of it."""
        if self.zero_stage < 3:
            return super().module_init_context(empty_init)
        import deepspeed

        from fabric.utilities.init import _EmptyInit

        stack = ExitStack()
        stack.enter_context(_EmptyInit(enabled=bool(empty_init)))
        stack.enter_context(self.precision.module_init_context())
        # No dtype=: DeepSpeed reads it from the config's fp16/bf16 sections. An explicit dtype goes through
        # DeepSpeed's `_set_dtype`, whose operator precedence turns it into bfloat16 on a CPU without float16
        # support, and the first forward then mixes float32 inputs with bfloat16 weights.
        stack.enter_context(deepspeed.zero.Init(remote_device=self.remote_device, config_dict_or_path=self.config))
        return stack

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """DeepSpeed accumulates gradients itself; skipping its synchronisation is not possible."""
        raise NotImplementedError(
            "fabric.no_backward_sync(): DeepSpeed cannot skip gradient synchronisation. Set "
            "'gradient_accumulation_steps' in the DeepSpeed config instead and call fabric.backward and "
            "optimizer.step on every micro-batch; DeepSpeed steps only at the accumulation boundary."
        )

    # -- training step ------------------------------------------------------------------------------
    def _require_engine(self, operation: str, needs_optimizer: bool = True) -> DeepSpeedEngine:
        engine = self._engine
        if engine is None or (needs_optimizer and engine.optimizer is None):
            raise RuntimeError(
                f"{operation}: the DeepSpeed engine has no optimizer (the model was set up without one, for "
                "inference). Set both up together: model, optimizer = fabric.setup(model, optimizer)."
            )
        return engine

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """engine.backward: loss scaling and the ZeRO gradient reduce-scatter happen inside."""
        engine = self._require_engine("fabric.backward(loss)")
        with self._collective("backward"):
            engine.backward(tensor, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """engine.step: the sharded step, the parameter all-gather, gradient zeroing, LR schedule of the config."""
        if kwargs.get("closure") is not None:
            raise FabricTypeError(
                "optimizer.step(closure=...): DeepSpeed cannot re-evaluate a closure inside its step. Call the "
                "closure yourself, then fabric.backward(loss) and optimizer.step()."
            )
        engine = self._require_engine("optimizer.step()")
        engine.step()
        if self._clip_pending:
            # clip_gradients applies to one step; later steps use the config's gradient_clipping again.
            engine.optimizer.clip_grad = engine.gradient_clipping()
            self._clip_pending = False

    def clip_gradients_norm(
        self, module: Module, optimizer: Optimizer, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> Tensor:
        """Clip the global norm over all shards at the next step; returns that norm."""
        from fabric.strategies.deepspeed.clip import clip_next_step

        engine = self._require_engine("fabric.clip_gradients(max_norm=...)")
        norm, pending = clip_next_step(engine, max_norm, norm_type, error_if_nonfinite)
        self._clip_pending = self._clip_pending or pending
        return norm

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float) -> None:
        """Not possible: DeepSpeed keeps reduced gradients in flat shards it only exposes to its own step."""
        raise NotImplementedError(
            f"fabric.clip_gradients(clip_val={clip_val}): DeepSpeed cannot clamp gradient values. Clip by norm "
            "with fabric.clip_gradients(model, optimizer, max_norm=...), or set 'gradient_clipping' in the config."
        )

    # -- checkpoints --------------------------------------------------------------------------------
    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """This rank's shard of the optimizer state (DeepSpeed's format); fabric.save writes all shards."""
        engine = self._require_engine("optimizer.state_dict()")
        return engine.optimizer.state_dict()

    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Every rank writes its shard of DeepSpeed's native checkpoint directory, atomically."""
        from fabric.strategies.deepspeed import state as _deepspeed_state

        if storage_options is not None:
            raise FabricTypeError(
                "save(storage_options=...): DeepSpeed writes its checkpoint files itself, without a CheckpointIO. "
                "Drop storage_options."
            )
        engine = self._require_engine("fabric.save()", needs_optimizer=False)
        _deepspeed_state.save(
            engine, path, state, filter, self.is_global_zero, self.barrier, self.exclude_frozen_parameters
        )

    def load_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any] | Module | Optimizer | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore from a DeepSpeed directory; `state=None` returns it consolidated; a module loads full weights."""
        from fabric.strategies.deepspeed import checkpoint as _deepspeed_checkpoint
        from fabric.strategies.deepspeed import state as _deepspeed_state

        if state is None:
            return _deepspeed_checkpoint.consolidate_deepspeed(path, weights_only, op="load")
        engine = self._require_engine("fabric.load()", needs_optimizer=False)
        if isinstance(state, Optimizer):
            raise FabricTypeError(
                f"fabric.load_raw({str(path)!r}, optimizer): a DeepSpeed optimizer's state is sharded and can only "
                "be restored from a DeepSpeed checkpoint. Use fabric.load(path, {'model': ..., 'optimizer': ...})."
            )
        if isinstance(state, Module):
            weights = self._read_full_weights(path, weights_only)
            _deepspeed_state.load_full_weights(engine, weights, strict, str(path))
            return {}
        return _deepspeed_state.load(
            engine, path, state, strict, self.world_size, self.is_global_zero, weights_only=weights_only
        )

    def _read_full_weights(self, path: str | Path, weights_only: bool | None) -> dict[str, Any]:
        from fabric.strategies.deepspeed import checkpoint as _deepspeed_checkpoint

        if _deepspeed_checkpoint.is_deepspeed_checkpoint(path):
            return _deepspeed_checkpoint.full_weights(path, weights_only=weights_only)
        return self.checkpoint_io.load_checkpoint(path, map_location="cpu", weights_only=weights_only)


def _check_optimizer_fits(module: Module, optimizer: Optimizer) -> None:
    """DeepSpeed maps every optimizer parameter to a model parameter; a foreign one fails deep inside it."""
    own = {id(param) for param in module.parameters()}
    foreign = sum(1 for group in optimizer.param_groups for param in group["params"] if id(param) not in own)
    if foreign:
        raise FabricValueError(
            f"fabric.setup({type(module).__name__}, {type(optimizer).__name__}): {foreign} of the optimizer's "
            "parameters do not belong to the model. Create the optimizer from this model's parameters: "
            "optimizer = torch.optim.AdamW(model.parameters())."
        )


def _check_precision_plugin(precision: Precision) -> DeepSpeedPrecision:
    """Only a DeepSpeedPrecision describes what the engine does; autocast or a GradScaler would fight it."""
    from fabric.precision.deepspeed import DeepSpeedPrecision

    if not isinstance(precision, DeepSpeedPrecision):
        name = getattr(precision, "precision", "32-true")
        raise FabricTypeError(
            f"Fabric(strategy='deepspeed', plugins=[{type(precision).__name__}]): DeepSpeed casts the model and "
            "scales the loss itself, so its precision must be a DeepSpeedPrecision. Pass "
            f"precision={name!r}, or plugins=[DeepSpeedPrecision({name!r})]."
        )
    return precision


def _forget_deepspeed_groups() -> None:
    """DeepSpeed caches subgroups of the world group in module globals; drop them with the group they came from.

    Otherwise a later Fabric in this process (a new process group) gets the destroyed ones back from DeepSpeed.
    """
    import sys

    groups = sys.modules.get("deepspeed.utils.groups")
    for name in ("_WORLD_GROUP", "_ZERO_PARAM_INTRA_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP"):
        if groups is not None and hasattr(groups, name):
            setattr(groups, name, None)


def _release_at_exit(strategy: weakref.ref) -> None:
    """Tear the strategy down if the user did not; otherwise drop what DeepSpeed still holds of its group."""
    alive = strategy()
    if alive is not None:
        alive.teardown()
        return
    _forget_deepspeed_groups()
    gc.collect()  # the engine's reference cycles hold the group; free them while the interpreter is whole
