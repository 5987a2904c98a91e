"""XLAFSDPStrategy (`xla_fsdp`): torch_xla's fully sharded data parallel (FSDP v1), one process per XLA device."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from functools import partial
from pathlib import Path
from typing import Any, Literal

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.accelerators.accelerator import Accelerator
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies.xla import fsdp_checkpoint
from fabric.strategies.xla._parallel import XLAParallelStrategy
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

_Policy = set[type[Module]] | Callable[..., bool]


class XLAFSDPStrategy(XLAParallelStrategy):
    """Shards parameters, gradients and optimizer state over the processes with XlaFullyShardedDataParallel.

    Args:
        auto_wrap_policy: which submodules get their own FSDP unit: a set of layer classes, or a policy callable
            as torch_xla's ``auto_wrap_policy`` takes.
        activation_checkpointing_policy: a set of layer classes whose activations are recomputed in backward.
        state_dict_type: ``"sharded"`` (default): a directory with one file per process, for resuming;
            ``"full"``: one file with the full, unwrapped model weights (rank 0 consolidates; one host only).
        sequential_save: processes of a host write their shards one after another (less host memory at once).
        **kwargs: passed to ``XlaFullyShardedDataParallel``.
    """

    _name = "xla_fsdp"

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
        auto_wrap_policy: _Policy | None = None,
        activation_checkpointing_policy: set[type[Module]] | None = None,
        state_dict_type: Literal["full", "sharded"] = "sharded",
        sequential_save: bool = False,
        start_method: str = "fork",
        **kwargs: Any,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            checkpoint_io=checkpoint_io,
            precision=precision,
            start_method=start_method,
        )
        if state_dict_type not in ("full", "sharded"):
            raise FabricValueError(
                f"XLAFSDPStrategy(state_dict_type={state_dict_type!r}): unknown checkpoint layout. Use 'sharded' "
                "(one file per process) or 'full' (one file with the whole model)."
            )
        if activation_checkpointing_policy is not None and not isinstance(activation_checkpointing_policy, set):
            raise FabricTypeError(
                f"XLAFSDPStrategy(activation_checkpointing_policy={activation_checkpointing_policy!r}): expected a "
                "set of layer classes such as {Block}. For anything else pass auto_wrapper_callable= yourself."
            )
        if activation_checkpointing_policy and "auto_wrapper_callable" in kwargs:
            raise FabricValueError(
                "XLAFSDPStrategy(activation_checkpointing_policy=..., auto_wrapper_callable=...): both decide how "
                "submodules are wrapped. Pass one of them."
            )
        self._auto_wrap_policy = auto_wrap_policy
        self._checkpointing_policy = activation_checkpointing_policy
        self._state_dict_type = state_dict_type
        self._sequential_save = sequential_save
        self._fsdp_kwargs = kwargs

    # -- setup ----------------------------------------------------------------------------------------
    def setup_module_and_optimizers(
        self, module: Module, optimizers: Iterable[Optimizer]
    ) -> tuple[Module, list[Optimizer]]:
        """Only a model alone: wrapping replaces its parameters, so optimizers must be created afterwards."""
        optimizers = list(optimizers)
        if optimizers:
            raise RuntimeError(
                "fabric.setup(model, optimizer) with strategy='xla_fsdp': wrapping the model replaces its parameters "
                "with shards, so an optimizer created before holds parameters that are no longer trained. Call "
                "model = fabric.setup_module(model), then create the optimizer from model.parameters() and call "
                "optimizer = fabric.setup_optimizers(optimizer)."
            )
        return self.setup_module(module), []

    def setup_module(self, module: Module) -> Module:
        """Wrap in XlaFullyShardedDataParallel (the root always; submodules as the policies say)."""
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

        if isinstance(module, XlaFullyShardedDataParallel):
            return module
        kwargs = self._wrapper_kwargs()
        if "auto_wrap_policy" in kwargs and any(isinstance(m, XlaFullyShardedDataParallel) for m in module.modules()):
            raise FabricValueError(
                "XLAFSDPStrategy(auto_wrap_policy=...): the model already contains XlaFullyShardedDataParallel "
                "submodules, and the policy would wrap them again. Drop the policy, or pass the unwrapped model."
            )
        return XlaFullyShardedDataParallel(module, **kwargs)

    def _wrapper_kwargs(self) -> dict[str, Any]:
        from fabric.precision.xla import XLAPrecision

        kwargs = dict(self._fsdp_kwargs)
        if isinstance(self.precision, XLAPrecision):
            kwargs.setdefault("compute_dtype", self.precision.dtype)
        if isinstance(self._auto_wrap_policy, set):
            from torch_xla.distributed.fsdp.wrap import transformer_auto_wrap_policy

            # Wraps every instance of the given classes, whatever they are (not only transformer blocks).
            kwargs["auto_wrap_policy"] = partial(
                transformer_auto_wrap_policy, transformer_layer_cls=self._auto_wrap_policy
            )
        elif self._auto_wrap_policy is not None:
            kwargs["auto_wrap_policy"] = self._auto_wrap_policy
        if self._checkpointing_policy:
            kwargs["auto_wrapper_callable"] = partial(_checkpointing_wrapper, tuple(self._checkpointing_policy))
        return kwargs

    def module_to_device(self, module: Module) -> None:
        """Nothing: the wrapper moves each shard to the device as it creates it."""

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Create the model on the CPU (the wrapper shards it onto the device), in the precision's dtype."""
        from fabric.utilities.init import _EmptyInit

        stack = ExitStack()
        stack.enter_context(_EmptyInit(enabled=bool(empty_init)))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Check that the optimizer holds the wrapped model's shards (it was created after setup_module)."""
        if any(getattr(p, "_is_sharded", False) for group in optimizer.param_groups for p in group["params"]):
            return optimizer
        raise FabricValueError(
            f"fabric.setup_optimizers({type(optimizer).__name__}): the optimizer holds none of the sharded "
            "parameters of an xla_fsdp model. Create it after model = fabric.setup_module(model), from "
            "model.parameters()."
        )

    # -- steps ----------------------------------------------------------------------------------------
    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step, then run the pending graph: gradients were already reduced and scattered in backward."""
        import torch_xla

        result = optimizer.step(**kwargs)
        torch_xla.sync()
        return result

    def clip_gradients_norm(
        self, module: Module, optimizer: Optimizer, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> Tensor:
        """Clip by the norm over every process's shards (the wrapper's own clip_grad_norm_)."""
        wrapper = _fsdp_module(module, "clip_gradients")
        return wrapper.clip_grad_norm_(max_norm=max_norm, norm_type=norm_type)  # type: ignore[operator]

    def clip_gradients_value(self, module: Module, optimizer: Optimizer, clip_val: float) -> None:
        """Refused: a value clip on shards is fine, but XlaFullyShardedDataParallel offers only norm clipping."""
        raise NotImplementedError(
            f"fabric.clip_gradients(clip_val={clip_val}) with strategy='xla_fsdp': torch_xla's FSDP clips gradients "
            "by norm only. Pass max_norm= instead, or use strategy='xla'."
        )

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """The wrapper's no_sync: gradients accumulate unsharded until the next synchronised backward."""
        if not enabled:
            return nullcontext()
        return _fsdp_module(module, "no_backward_sync").no_sync()  # type: ignore[operator]

    # -- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """A directory of shards (one file per process), or with state_dict_type='full' one file of full weights."""
        fsdp_checkpoint.save(self, Path(path), state, storage_options, filter)

    def load_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any] | Module | Optimizer | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Each process reads its own shard of a sharded directory; a full file loads like any plain checkpoint."""
        from fabric.checkpoint.xla_fsdp import is_xla_fsdp_checkpoint

        if is_xla_fsdp_checkpoint(path):
            return fsdp_checkpoint.load_shard(self, Path(path), state, strict, weights_only)
        fsdp_checkpoint.check_full_load(path, state)
        return super().load_checkpoint(path, state, strict, weights_only)


def _fsdp_module(module: Module, operation: str) -> Module:
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    wrapper = getattr(module, "_forward_module", module)
    if not isinstance(wrapper, XlaFullyShardedDataParallel):
        raise FabricTypeError(
            f"{operation}({type(module).__name__}) with strategy='xla_fsdp': this model is not sharded by the "
            "strategy. Pass the model that fabric.setup_module() returned."
        )
    return wrapper


def _checkpointing_wrapper(classes: tuple[type[Module], ...], module: Module, *args: Any, **kwargs: Any) -> Module:
    """Wrap `module` in FSDP, recomputing its activations in backward when it is one of `classes`."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel, checkpoint_module

    if isinstance(module, classes):
        module = checkpoint_module(module)
    return XlaFullyShardedDataParallel(module, *args, **kwargs)
