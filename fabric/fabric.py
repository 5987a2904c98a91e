"""The Fabric facade: flags -> Connector -> one Strategy; wraps the user's objects."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Generator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric import _collectives, _lightning_module, _mistakes, _setup
from fabric._connector import connect
from fabric._hooks import call_hook
from fabric.accelerators.accelerator import Accelerator
from fabric.accelerators.cuda import check_bf16_supported
from fabric.checkpoint import state as _checkpoint
from fabric.io._fsspec import expand_user
from fabric.io._load import check_weights_only
from fabric.loggers.logger import Logger
from fabric.strategies.strategy import Strategy
from fabric.utilities.apply_func import move_to_device
from fabric.utilities.device_dtype_mixin import update_device_dtype
from fabric.utilities.exceptions import FabricTypeError
from fabric.utilities.seed import seed_everything as _seed_everything
from fabric.wrappers import (
    _BackwardState,
    _FabricModule,
    _FabricOptimizer,
    _module_dtype,
    _uncompiled,
    unwrap_objects,
)

if TYPE_CHECKING:
    # torch.utils.data is only needed once loaders are set up; importing it eagerly costs ~70 ms.
    from torch.utils.data import DataLoader

    from fabric.precision.precision import Precision


class Fabric:
    """Adds multi-process, multi-device and mixed-precision training to a raw PyTorch loop."""

    # A LightningModule set up with this Fabric sees it as its trainer; LightningModule.print asks the trainer for a
    # progress bar to print through. Fabric draws none, so it prints directly (on global rank 0).
    progress_bar_callback: None = None

    def __init__(
        self,
        *,
        accelerator: str | Accelerator = "auto",
        strategy: str | Strategy = "auto",
        devices: list[int] | str | int = "auto",
        num_nodes: int = 1,
        precision: str | int | None = None,
        plugins: Any | list[Any] | None = None,
        callbacks: Any | list[Any] | None = None,
        loggers: Logger | list[Logger] | None = None,
    ) -> None:
        # _under_cli: `fabric run` started this process, so the processes exist and launch() is optional.
        self._strategy, self._under_cli = connect(accelerator, strategy, devices, num_nodes, precision, plugins)
        self._callbacks = _setup.as_list(callbacks)
        self._loggers = _setup.as_list(loggers)
        _mistakes.check_loggers(self._loggers)
        # Per object, not per process: two Fabrics in one process each check and warn on their own.
        self._warn_once = _mistakes.WarnOnce()
        self._setup_record = _mistakes.SetupRecord()
        self._backward_checked = False
        # _launched: this process's environment is set up. _launch_called: the user called launch().
        self._launched = False
        self._launch_called = False
        self._collective_device: torch.device | None = None  # the root device, once a collective asked for it
        self._backward_state = _BackwardState()
        # The wrappers' output hooks read the state of a backward the precision must see.
        self._tracked_backward = self._strategy.precision.requires_fabric_backward
        # Decided at the first backward (`_first_backward`): whether `fabric.backward(loss)` is `loss.backward()`
        # (no loss scaling, nothing the strategy adds but a count), and what counts it for the hang diagnosis.
        self._plain_backward = False
        self._backward_counter: Any = None
        self._preempt_announced = False
        if type(self).run is not Fabric.run:
            # Lightning's subclass style: MyFabric(...).run(args) launches the processes and runs it in each.
            self.run = partial(self._launch_run, self.run)  # type: ignore[method-assign]

    # -- properties -----------------------------------------------------------------------------
    @property
    def accelerator(self) -> Accelerator:
        """The hardware in use."""
        assert self._strategy.accelerator is not None, "the connector always sets one"
        return self._strategy.accelerator

    @property
    def strategy(self) -> Strategy:
        """The strategy in use."""
        return self._strategy

    @property
    def _precision(self) -> Precision:
        """The strategy's precision plugin (Lightning's private name, which client code reads)."""
        return self._strategy.precision

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return self._strategy.root_device

    @property
    def global_rank(self) -> int:
        """Rank of this process among all processes."""
        return self._strategy.global_rank

    @property
    def local_rank(self) -> int:
        """Rank of this process on its machine."""
        return self._strategy.local_rank

    @property
    def node_rank(self) -> int:
        """Rank of this machine."""
        return self._strategy.node_rank

    @property
    def world_size(self) -> int:
        """Number of processes."""
        return self._strategy.world_size

    @property
    def is_global_zero(self) -> bool:
        """Whether this process has global rank 0."""
        return self._strategy.is_global_zero

    @property
    def loggers(self) -> list[Logger]:
        """All loggers."""
        return self._loggers

    @property
    def logger(self) -> Logger:
        """The first logger."""
        if not self._loggers:
            raise RuntimeError(
                "fabric.logger: no logger was configured. Pass loggers=CSVLogger('logs') (or another Logger) "
                "to Fabric(...)."
            )
        return self._loggers[0]

    # -- launching ------------------------------------------------------------------------------
    def launch(self, function: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
        """Start the processes (if fabric starts them) and join the process group; run `function(fabric, *args)`."""
        if self._launch_called:
            raise RuntimeError(
                "fabric.launch(): launch was already called for this Fabric object, and the processes exist. "
                "Call it once, at the start of your script."
            )
        launcher = self._strategy.launcher
        self._launch_called = True
        if function is not None:
            _setup.check_launch_function(function, args, kwargs)
        elif launcher is not None and not launcher.continues_script:
            raise FabricTypeError(
                f"fabric.launch(): strategy {type(self._strategy).__name__} starts new processes that run a "
                "function, not the rest of your script. Pass it: fabric.launch(train), with def train(fabric): ..."
            )
        if launcher is None:
            return self._run_worker(function, args, kwargs)
        return launcher.launch(self._run_worker, function, args, kwargs)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """Override in a subclass to hold the training code; calling it launches the processes and runs it in each."""

    def _launch_run(self, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return self.launch(_call_run, run, *args, **kwargs)

    def _run_worker(self, function: Callable[..., Any] | None, args: tuple, kwargs: dict) -> Any:
        self._setup_process()
        if function is None:
            return None
        launcher = self._strategy.launcher
        try:
            result = function(self, *args, **kwargs)
        except Exception:
            self._strategy.preemption.report_failure()  # the other ranks must not take the end for a preemption
            raise
        if launcher is not None and not launcher.continues_script:
            # A worker that only runs `function` leaves the process group cleanly when it returns. On an
            # exception it does not: the launcher first records which rank failed, and exiting tears down.
            self._strategy.teardown()
        return result

    def _validate_launched(self, method: str = "_validate_launched") -> None:
        if self._launched:
            return
        if self._launch_called:
            raise RuntimeError(
                f"fabric.{method}() was called in the process that called fabric.launch(fn), which only starts "
                f"the workers of strategy {type(self._strategy).__name__} and waits for them. Call it inside fn, "
                "which runs in every worker."
            )
        if self._strategy.requires_launch and not self._under_cli:
            raise RuntimeError(
                f"fabric.{method}() was called before fabric.launch(), so the {self.world_size} processes of "
                f"strategy {type(self._strategy).__name__} do not exist yet. Call fabric.launch() first (or "
                "pass your training function to fabric.launch)."
            )
        self._setup_process()

    def _setup_process(self) -> None:
        self._strategy.setup_environment()
        name = getattr(self._strategy.precision, "precision", None)
        if isinstance(name, str) and name.startswith("bf16"):
            # Here, not in Fabric(...): asking CUDA in the parent process would stop ddp_fork from forking.
            check_bf16_supported(self._strategy.root_device, name)
        self._launched = True

    @property
    def preempted(self) -> bool:
        """Whether the job got a preemption signal (SIGTERM; SIGUSR1 too in SLURM): save and exit when True.

        True at the same check on every rank, so read it at the same place in the loop on all of them. The first
        read starts catching the signals (until then they end the process as usual); the first True calls the
        callbacks' `on_preempt(fabric)`.
        """
        self._validate_launched("preempted")
        preemption = self._strategy.preemption
        if not preemption.arm():
            warnings.warn(
                "fabric.preempted was read outside the main thread, where Python cannot catch signals, so a "
                "preemption signal still ends the process at once. Read it in the main thread.",
                stacklevel=2,
            )
        if not preemption.check():
            return False
        if not self._preempt_announced:
            self._preempt_announced = True
            self.call("on_preempt", fabric=self)
        return True

    # -- setup ----------------------------------------------------------------------------------
    def setup(
        self,
        module: Module,
        *optimizers: Optimizer,
        scheduler: Any = None,
        move_to_device: bool = True,
        _reapply_compile: bool = True,
    ) -> Any:
        """Set up a model and its optimizers; returns the model, or (model, *optimizers[, scheduler])."""
        self._validate_launched("setup")
        self._setup_record.check_new_module("setup", module, self._strategy, self._warn_once)
        self._setup_record.check_new_optimizers("setup", optimizers)
        if scheduler is not None:
            _setup.check_scheduler(scheduler, optimizers, self._strategy)
        name = type(self._strategy).__name__
        _mistakes.check_optimizer_params(module, optimizers, self.world_size, name, self._warn_once)
        user_module = module
        module = self._strategy.precision.convert_module(module)
        if move_to_device:
            self._strategy.module_to_device(module)
        forward_module, opts = self._strategy.setup_module_and_optimizers(module, optimizers)
        self._strategy._reserve_async_save_memory(module, opts)
        original = _uncompiled(module) if _reapply_compile else module
        wrapped = self._wrap_module(forward_module, original, move_to_device, user_module)
        wrapped_opts = [_FabricOptimizer(opt, self._strategy, self._callbacks) for opt in opts]
        self._setup_record.add_module(user_module)
        self._setup_record.add_optimizers(optimizers)
        _lightning_module.attach(original, self, self._callbacks, wrapped_opts)
        self.call("on_after_setup", fabric=self, module=wrapped)
        if not optimizers:
            return wrapped
        return (wrapped, *wrapped_opts) if scheduler is None else (wrapped, *wrapped_opts, scheduler)

    def setup_module(self, module: Module, move_to_device: bool = True, _reapply_compile: bool = True) -> _FabricModule:
        """Set up a model alone (call before creating optimizers for sharded strategies)."""
        self._validate_launched("setup_module")
        self._setup_record.check_new_module("setup_module", module, self._strategy, self._warn_once)
        user_module = module
        module = self._strategy.precision.convert_module(module)
        if move_to_device:
            self._strategy.module_to_device(module)
        original = _uncompiled(module) if _reapply_compile else module
        wrapped = self._wrap_module(self._strategy.setup_module(module), original, move_to_device, user_module)
        self._setup_record.add_module(user_module)
        # Lightning fires on_after_setup from setup() only, and attaches no optimizers here.
        _lightning_module.attach(original, self, self._callbacks, None)
        return wrapped

    def setup_optimizers(self, *optimizers: Optimizer) -> Any:
        """Set up optimizers whose model is already set up; returns one or a tuple."""
        self._validate_launched("setup_optimizers")
        if self._strategy.requires_joint_setup:
            raise RuntimeError(
                f"fabric.setup_optimizers(): strategy {type(self._strategy).__name__} must see the model and its "
                "optimizers together. Call model, optimizer = fabric.setup(model, optimizer) instead."
            )
        if not optimizers:
            raise FabricTypeError("fabric.setup_optimizers(): no optimizer was passed. Pass at least one optimizer.")
        self._setup_record.check_new_optimizers("setup_optimizers", optimizers)
        wrapped = []
        for opt in optimizers:
            wrapped.append(_FabricOptimizer(self._strategy.setup_optimizer(opt), self._strategy, self._callbacks))
        self._setup_record.add_optimizers(optimizers)
        return wrapped[0] if len(wrapped) == 1 else tuple(wrapped)

    def setup_dataloaders(
        self,
        *dataloaders: DataLoader,
        use_distributed_sampler: bool = True,
        move_to_device: bool = True,
        even_batches: bool = True,
        freeze_gc: bool = False,
    ) -> Any:
        """Shard each loader across processes (via the strategy), seed its workers, move batches to the device.

        Args:
            *dataloaders: the loaders to set up.
            use_distributed_sampler: shard the data across processes (a `DistributedSampler`, or your sampler
                wrapped so that each process reads its share).
            move_to_device: move every batch to `fabric.device`.
            even_batches: `True` (the default, as in Lightning Fabric): every process gets the same number of
                batches; the last shard is padded with repeated samples when the dataset does not divide evenly.
                `False`: every sample is read by exactly one process, none repeated, none dropped (for exact
                evaluation); processes may then get one batch fewer than others, so the loop over such a loader
                must not call collectives per batch (no `fabric.backward` under DDP, no `all_gather` per batch):
                collect locally and gather or reduce after the loop. See docs/exact_evaluation.md.
            freeze_gc: `gc.freeze()` while worker processes are forked at each epoch start, `gc.unfreeze()` right
                after: forked workers then never scan (and so never copy) the objects of this process. Only with
                `num_workers > 0` and the fork start method; see docs/dataloaders.md.
        """
        self._validate_launched("setup_dataloaders")
        if not dataloaders:
            raise FabricTypeError("fabric.setup_dataloaders(): no DataLoader was passed. Pass at least one.")
        if not isinstance(freeze_gc, bool):
            raise FabricTypeError(
                f"fabric.setup_dataloaders(freeze_gc={freeze_gc!r}): freeze_gc is a switch. Pass True or False."
            )
        loaders = [
            _setup.setup_dataloader(self._strategy, d, use_distributed_sampler, move_to_device, even_batches)
            for d in dataloaders
        ]
        # One watch per Fabric: its optimizers' steps tell each loader which batch the loop has used (docs/resume.md).
        steps = self.__dict__.get("_loader_steps")
        if steps is None:
            from fabric._dataloader import _StepWatch

            refs = self._setup_record._optimizers  # the user's optimizers that setup() saw, by weak reference
            steps = self._loader_steps = _StepWatch(lambda: [o for ref in refs.values() if (o := ref()) is not None])
        for loader in loaders:
            loader._configure(freeze_gc, steps)
        return loaders[0] if len(loaders) == 1 else loaders

    def _wrap_module(self, forward_module: Module, original: Module, moved: bool, user_module: Module) -> _FabricModule:
        state = self._backward_state if self._strategy.precision.requires_fabric_backward else None
        guard = _mistakes.existing_guard(user_module)
        if guard is None and forward_module is not user_module and self.world_size > 1:
            # Calling the user's module directly would go around the strategy: watch for it (see _mistakes).
            name = type(self._strategy).__name__
            guard = _mistakes.guard_forward(user_module, name, self.world_size, self._warn_once)
        wrapped = _FabricModule(forward_module, original, self._strategy.precision, state, guard)
        # Sharded strategies and move_to_device=False leave no single root device: report where the weights are.
        first = next(original.parameters(), None)
        device = self.device if moved or first is None else first.device
        update_device_dtype(wrapped, device=device)
        wrapped._dtype = _module_dtype(original)
        return wrapped

    # -- training step --------------------------------------------------------------------------
    def backward(self, tensor: Tensor, *args: Any, model: _FabricModule | None = None, **kwargs: Any) -> None:
        """Use instead of `loss.backward()`: goes through the strategy and precision (loss scaling, ...)."""
        if not isinstance(tensor, Tensor):  # checked here, not in a call: this runs every step
            _mistakes.check_loss(tensor)
        if not self._backward_checked:
            self._first_backward()
        if self._plain_backward:
            counter = self._backward_counter
            if counter is not None:  # DDP on gloo: the backward's all-reduce is a collective (hang diagnosis)
                counter.backwards += 1
            try:
                if args or kwargs:  # forwarding empty star-arguments builds a tuple and a dict (every step)
                    tensor.backward(*args, **kwargs)
                else:
                    tensor.backward()
            except RuntimeError as err:
                self._strategy._backward_failed(err, counter)
                raise
            return
        module = model._forward_module if model is not None and isinstance(model, _FabricModule) else model
        if not self._tracked_backward:  # nothing reads the state: no try/finally around it (DDP, every step)
            # Forwarding empty star-arguments builds a tuple and a dict per call (about 0.3 us, every step).
            if args or kwargs:
                self._strategy.backward(tensor, module, *args, **kwargs)
            else:
                self._strategy.backward(tensor, module)
            return
        self._backward_state.active = True
        try:
            self._strategy.backward(tensor, module, *args, **kwargs)
        finally:
            self._backward_state.active = False

    def _first_backward(self) -> None:
        # Once per Fabric: a set-up model stays set up, it warns at most once, and the processes exist by now.
        name = type(self._strategy).__name__
        _mistakes.check_backward_has_model(self._setup_record.has_modules, self.world_size, name)
        plain, self._backward_counter = self._strategy._fast_backward()
        self._plain_backward = plain and not self._tracked_backward
        self._backward_checked = True

    def pipeline_step(self, model: _FabricModule, *inputs: Any, target: Any = None) -> Tensor:
        """Under PipelineStrategy, instead of `model(x)` and `fabric.backward(loss)`: forward and backward of the
        batch over the microbatches on every stage; returns the mean loss, a 0-dim tensor on every rank."""
        if not isinstance(model, _FabricModule):
            raise FabricTypeError(
                f"fabric.pipeline_step({type(model).__name__}, ...): expected the model returned by fabric.setup(). "
                "Pass that model."
            )
        return self._strategy.pipeline_step(model._forward_module, inputs, target)

    def clip_gradients(
        self,
        module: Module,
        optimizer: Optimizer,
        clip_val: float | int | None = None,
        max_norm: float | int | None = None,
        norm_type: float | int = 2.0,
        error_if_nonfinite: bool = True,
    ) -> Tensor | None:
        """Clip by value (`clip_val`) or by total norm (`max_norm`, returns the norm); unscales first."""
        _mistakes.check_clip_limits(clip_val, max_norm)
        opt = unwrap_objects(optimizer)
        if max_norm is not None:
            return self._strategy.clip_gradients_norm(
                module, opt, float(max_norm), float(norm_type), error_if_nonfinite
            )
        self._strategy.clip_gradients_value(module, opt, float(clip_val))  # type: ignore[arg-type]
        return None

    def autocast(self) -> AbstractContextManager:
        """The precision's forward context, for code that runs outside the model's forward."""
        return self._strategy.precision.forward_context()

    def no_backward_sync(self, module: _FabricModule, enabled: bool = True) -> AbstractContextManager:
        """Skip gradient synchronisation while accumulating gradients over several backward calls."""
        if not isinstance(module, _FabricModule):
            raise FabricTypeError(
                f"fabric.no_backward_sync({type(module).__name__}): expected the model returned by fabric.setup(). "
                "Pass that model."
            )
        if not enabled:
            return nullcontext()
        return self._strategy.no_backward_sync(module._forward_module, enabled)

    def to_device(self, obj: Any) -> Any:
        """Move a module, a tensor, or a collection of tensors to this process's device."""
        if isinstance(obj, Module):
            self._strategy.module_to_device(obj)
            return obj
        return move_to_device(obj, self.device)

    def init_module(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Create the model directly on the device in the target dtype; `empty_init` skips weight init."""
        self._validate_launched("init_module")
        return self._strategy.module_init_context(empty_init=empty_init)

    def sharded_model(self) -> AbstractContextManager:
        """Deprecated: use `init_module()`, which this now is."""
        if self.global_rank == 0:
            warnings.warn(
                "fabric.sharded_model() is deprecated, as in Lightning Fabric. Use fabric.init_module() instead: it "
                "creates the model on the device, in the precision's dtype, sharded where the strategy shards.",
                DeprecationWarning,
                stacklevel=2,
            )
        return self.init_module()

    def init_tensor(self) -> AbstractContextManager:
        """Create tensors directly on the device in the target dtype."""
        return self._strategy.tensor_init_context()

    # -- collectives ----------------------------------------------------------------------------
    def barrier(self, name: str | None = None) -> None:
        """Wait until every process reaches this point."""
        if not self._launched:  # inline: a barrier is latency-bound, and Python before it adds to that latency
            self._validate_launched("barrier")
        strategy = self._strategy
        strategy.wait_for_checkpoints()  # checkpoints saved in the background are complete after a barrier
        strategy.barrier(name=name)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from process `src` to all processes."""
        if not self._launched:  # inline: a small collective is latency-bound, and Python before it adds to that
            self._validate_launched("broadcast")
        return self._strategy.broadcast(obj, src=src)

    def all_gather(self, data: Any, group: Any | None = None, sync_grads: bool = False, *, uneven: bool = False) -> Any:
        """Gather tensors (or numbers, or collections of them) from all processes.

        Args:
            data: a tensor, a number, or a nested collection (dict, list, tuple, dataclass) of them.
            group: the process group to gather over (default: all processes).
            sync_grads: make the result differentiable; the backward pass sends each process the summed
                gradient of its own part.
            uneven: allow tensors whose shape differs between processes (see below). It costs one small extra
                collective per call and, on a GPU or TPU, a wait for the device; leave it off where the shapes
                are equal.

        Returns:
            `data` with each tensor replaced by the gathered values, stacked along a new first dimension,
            `(world_size, *shape)`, in one collective per tensor, as in Lightning Fabric. Every process must pass
            tensors of the same shape; torch does not check this (on gloo one process gets garbage and another
            aborts), but `FABRIC_DEBUG_COLLECTIVES=1` does. With `uneven=True`, a tensor whose shape differs
            between processes (any dimension, including 0 rows) becomes a list of `world_size` tensors, each
            exactly what that process sent, and every process must pass the same structure (keys, number of
            tensors, dtypes): a mismatch raises `ValueError` on every process rather than hanging. On one
            process each tensor is returned as it is.
        """
        if not self._launched:  # inline: a small collective is latency-bound, and Python before it adds to that
            self._validate_launched("all_gather")
        device = self._collective_device or self._find_collective_device()
        if type(data) is Tensor and not uneven and data.device == device:  # the common call: straight to the strategy
            return self._strategy.all_gather(data, group, sync_grads)
        return _collectives.all_gather(self._strategy, data, group, sync_grads, uneven, device)

    def all_reduce(self, data: Any, group: Any | None = None, reduce_op: str = "mean") -> Any:
        """Reduce tensors (or numbers, or collections of them) across processes: mean, sum, max or min."""
        if not self._launched:  # inline: a small collective is latency-bound, and Python before it adds to that
            self._validate_launched("all_reduce")
        device = self._collective_device or self._find_collective_device()
        if type(data) is Tensor and data.device == device:  # the common call: straight to the strategy
            return self._strategy.all_reduce(data, group, reduce_op)
        return _collectives.all_reduce(self._strategy, data, group, reduce_op, device)

    def _find_collective_device(self) -> torch.device:
        # The strategy's root device, looked up once: it is fixed once the processes exist, and the lookup reads
        # the environment (the local rank) on every call, which a collective of a few kilobytes would notice.
        self._collective_device = self._strategy.root_device
        return self._collective_device

    @contextmanager
    def rank_zero_first(self, local: bool = False) -> Generator[None, None, None]:
        """Let rank 0 (per machine with `local=True`) run the block first, e.g. to download data once."""
        rank = self.local_rank if local else self.global_rank
        if rank > 0:
            self.barrier()
        yield
        if rank == 0:
            self.barrier()

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print` on local rank 0 only (once per machine), as in Lightning Fabric."""
        if self.local_rank == 0:
            print(*args, **kwargs)

    # -- checkpoints ----------------------------------------------------------------------------
    def save(
        self,
        path: str | Path,
        state: dict[str, Any],
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Save modules, optimizers and plain values atomically; only the ranks the strategy allows write."""
        self._validate_launched("save")
        state = _checkpoint.with_scaler_state(state, self._strategy.precision.state_dict())
        self._strategy.wait_for_checkpoints()  # a previous background save that failed raises on every rank
        self._strategy.save_checkpoint(expand_user(path), state, filter=filter)
        self._strategy.barrier()  # not self.barrier(): that would wait for a save running in the background

    def load(
        self,
        path: str | Path,
        state: dict[str, Any] | None = None,
        strict: bool = True,
        *,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Restore `state` in place from a checkpoint; returns what the checkpoint held beyond `state`.

        `path` may be an fsspec URL (``s3://...``). By default (``weights_only=None`` or True) only tensors and
        plain Python values are unpickled; pass ``weights_only=False`` only for files you trust.
        """
        self._validate_launched("load")
        check_weights_only(weights_only, "load")
        self._strategy.wait_for_checkpoints()
        path = expand_user(path)  # '~/run.ckpt' is the home directory's, as in Lightning
        remainder = self._strategy.load_checkpoint(path, state=state, strict=strict, weights_only=weights_only)
        remainder = _checkpoint.restore_scaler_state(remainder, state, self._strategy.precision.load_state_dict)
        self.barrier()
        return remainder

    def load_raw(
        self, path: str | Path, obj: Module | Optimizer, strict: bool = True, *, weights_only: bool | None = None
    ) -> None:
        """Load a plain state dict file (e.g. from torch.save(model.state_dict())) into a module or optimizer."""
        self._validate_launched("load_raw")
        check_weights_only(weights_only, "load_raw")
        self._strategy.wait_for_checkpoints()
        self._strategy.load_checkpoint(expand_user(path), state=obj, strict=strict, weights_only=weights_only)

    # -- callbacks, logging, seeding --------------------------------------------------------------
    def call(self, hook_name: str, *args: Any, **kwargs: Any) -> None:
        """Call `hook_name` on every callback that defines it, passing only the keyword arguments it accepts."""
        call_hook(self._callbacks, hook_name, args, kwargs)

    def log(self, name: str, value: Any, step: int | None = None) -> None:
        """Log one metric to every logger (from global rank 0 only)."""
        self.log_dict({name: value}, step=step)

    def log_dict(self, metrics: Mapping[str, Any], step: int | None = None) -> None:
        """Log several metrics to every logger (from global rank 0 only)."""
        if not self._loggers or not self.is_global_zero:
            return
        values = {k: _setup.scalar(k, v) for k, v in metrics.items()}
        for logger in self._loggers:
            logger.log_metrics(values, step=step)

    @staticmethod
    def seed_everything(seed: int | None = None, workers: bool | None = None, verbose: bool = True) -> int:
        """Seed python, numpy and torch; with `workers` (default True) dataloader workers are seeded too."""
        return _seed_everything(seed, workers=True if workers is None else workers, verbose=verbose)


def _call_run(fabric: Fabric, run: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    return run(*args, **kwargs)
