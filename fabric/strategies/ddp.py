"""DistributedDataParallel: one strategy, three launchers (script re-run, spawn, fork)."""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module

from fabric.accelerators.accelerator import Accelerator
from fabric.diagnostics import track as _diagnostics
from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from fabric.utilities import distributed as _dist
from fabric.utilities.exceptions import FabricTypeError

if TYPE_CHECKING:
    # Imported lazily at run time: it pulls in torch.distributed.rpc, which costs tens of ms.
    from torch.nn.parallel import DistributedDataParallel


class DDPStrategy(ParallelStrategy):
    """Replicates the model in every process and averages gradients during backward."""

    repeatable_module_setup = True  # DDP wraps the module without changing it; each wrapper syncs its own calls

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
        **ddp_kwargs: Any,
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
        self._ddp_kwargs = ddp_kwargs
        # The models this strategy wrapped (weakly: the user owns them), to tell whether a backward all-reduces.
        # Weak references in a list, not a WeakSet: backward walks it every step, and a WeakSet's iterator costs
        # several Python calls. Dead ones are dropped at the next setup.
        self._ddp_modules: list[weakref.ref[Module]] = []

    def setup_module(self, module: Module) -> DistributedDataParallel:
        """Wrap in DDP; parameters are broadcast from rank 0 so every replica starts equal."""
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.root_device.index] if self.root_device.type == "cuda" else None
        # Built on the current (default) stream, as plain DDP is. Lightning built it on a side stream, which only
        # whole-network CUDA graph capture needs, and which makes every backward warn that AccumulateGrad's
        # stream differs from the producer's (Lightning has since dropped it). Capture users can enter their own
        # torch.cuda.stream(...) around fabric.setup.
        with self._collective("setup"):  # DDP's constructor broadcasts rank 0's weights
            wrapped = DistributedDataParallel(module, device_ids=device_ids, **self._ddp_kwargs)
        _dist.release_group_last(wrapped)
        self._ddp_modules = [ref for ref in self._ddp_modules if ref() is not None]
        self._ddp_modules.append(weakref.ref(wrapped))
        return wrapped

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward through the precision plugin. DDP's gradient all-reduce makes it a collective for the hang
        diagnosis: counted (see `track.backward_counter`), or entered and compared across ranks in debug mode."""
        precision = self._precision or self.precision  # called here, not through super(): this runs every step
        counter = _diagnostics.backward_counter()
        if counter is not None and counter.debug and self._backward_syncs(module):
            with self._collective("backward"):
                precision.backward(tensor, module, *args, **kwargs)
            return
        if counter is not None:
            counter.backwards += 1
        try:
            precision.backward(tensor, module, *args, **kwargs)
        except RuntimeError as err:
            self._backward_failed(err, counter)
            raise

    def _fast_backward(self) -> tuple[bool, Any]:
        """`backward` is torch's backward and a count where the precision adds nothing and no check runs."""
        counter = _diagnostics.backward_counter()
        precision = type(self._precision or self.precision)
        plain = type(self).backward is DDPStrategy.backward and precision.backward is Precision.backward
        return plain and (counter is None or not counter.debug), counter

    def _backward_failed(self, err: RuntimeError, counter: Any) -> None:
        _diagnostics.backward_failed(err, counter, self._timeout_words)

    def _backward_syncs(self, module: Module | None) -> bool:
        """Whether this backward all-reduces gradients."""
        if module is not None:
            return _syncs_gradients(module)
        # fabric.backward(loss) rarely names the model: then any model of ours that syncs makes it a collective.
        # A loop reading DDP's flags itself, not any(...) or a call per model: this runs every step.
        for ref in self._ddp_modules:
            ddp = ref()
            if getattr(ddp, "require_backward_grad_sync", False) and hasattr(ddp, "reducer"):
                return True
        return False

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """DDP's own no_sync: gradients accumulate locally until the next synced backward."""
        if not enabled:
            return nullcontext()
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(module, DistributedDataParallel):
            raise FabricTypeError(
                f"no_backward_sync({type(module).__name__}): gradient sync can only be skipped for a model "
                "returned by fabric.setup(). Pass the model that fabric.setup() returned."
            )
        return module.no_sync()


def _syncs_gradients(module: Module | None) -> bool:
    """Whether a backward through `module` all-reduces gradients (a DDP module outside no_sync)."""
    # DDP's own flag, without importing DDP (its import costs tens of ms): no_sync() turns it off. The same test
    # is written out in DDPStrategy._backward_syncs' loop.
    return bool(getattr(module, "require_backward_grad_sync", False)) and hasattr(module, "reducer")
