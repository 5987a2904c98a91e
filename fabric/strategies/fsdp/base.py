"""What FSDPStrategy and ModelParallelStrategy do alike around `fully_shard`: setup, sync, clipping, checkpoints."""

from __future__ import annotations

import weakref
from abc import abstractmethod
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, ExitStack, nullcontext
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.accelerators.accelerator import Accelerator
from fabric.checkpoint.async_saver import AsyncShardedSaver
from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.fsdp import as_fsdp_precision, check_fsdp_precision
from fabric.precision.precision import Precision
from fabric.strategies.fsdp import utils
from fabric.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

_STATE_DICT_TYPES = ("sharded", "full")


class _FullyShardedStrategy(ParallelStrategy):
    """Shards parameters with FSDP2; subclasses say how (`_shard`) and on which mesh (`_build_device_mesh`)."""

    @property
    def _forward_is_collective(self) -> bool:
        return True  # each forward all-gathers the parameter shards

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
        state_dict_type: str = "sharded",
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
        if state_dict_type not in _STATE_DICT_TYPES:
            raise FabricValueError(
                f"{type(self).__name__}(state_dict_type={state_dict_type!r}): unknown checkpoint layout. Use "
                "'sharded' (every rank writes its shards into a folder) or 'full' (rank 0 writes one file)."
            )
        self._state_dict_type = state_dict_type
        self._device_mesh: DeviceMesh | None = None
        # The modules set up so far, to find the model an optimizer belongs to (its state is keyed by names).
        self._sharded_modules: weakref.WeakSet[Module] = weakref.WeakSet()
        self._async_saver = AsyncShardedSaver()  # used when the CheckpointIO saves in the background
        if precision is not None:
            check_fsdp_precision(precision, type(self).__name__)

    def __getstate__(self) -> dict[str, Any]:
        """What the spawn launcher sends to each worker: not the modules set up so far (a WeakSet cannot be pickled,
        and those modules belong to this process)."""
        state = self.__dict__.copy()
        state["_sharded_modules"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._sharded_modules = weakref.WeakSet()

    def _connect(self, **components: Any) -> None:
        """Refuse a precision FSDP cannot honour here, when Fabric(...) is built, not at the first step."""
        super()._connect(**components)
        self._precision = as_fsdp_precision(self.precision, type(self).__name__)

    @property
    def device_mesh(self) -> DeviceMesh:
        """The mesh parameters are sharded over; it exists once the processes are launched."""
        if self._device_mesh is None:
            raise RuntimeError(
                f"{type(self).__name__}.device_mesh: the mesh is built when the process group exists. Call "
                "fabric.launch() first."
            )
        return self._device_mesh

    @property
    def state_dict_type(self) -> str:
        """'sharded' or 'full': the layout of checkpoints and of `get_*_state` results."""
        return self._state_dict_type

    def setup_environment(self) -> None:
        """Join the process group, then build the device mesh on it."""
        super().setup_environment()
        if self._device_mesh is None:
            self._device_mesh = self._build_device_mesh()

    @abstractmethod
    def _build_device_mesh(self) -> DeviceMesh:
        """The mesh for this run (called on every rank once the process group exists)."""

    @abstractmethod
    def _shard(self, module: Module) -> Module:
        """Apply fully_shard (and any other parallelism) in place; return the module to call forward on."""

    # -- modules and optimizers -----------------------------------------------------------------------------
    def module_to_device(self, module: Module) -> None:
        """Nothing: fully_shard moves each shard to the device, so the whole model never has to fit on one."""

    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Create parameters on the CPU, or with empty_init=True on the meta device (allocated after sharding).

        Never on the GPU: every rank would hold the whole model there before sharding, which is what FSDP (and
        CPU offload above all) exists to avoid. fully_shard moves each rank's shard to its device.
        """
        stack = ExitStack()
        stack.enter_context(torch.device("meta" if empty_init else "cpu"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def setup_module(self, module: Module) -> Module:
        """Shard the module; a meta-device module is then allocated and initialised with reset_parameters()."""
        utils.check_has_parameters(module, type(self).__name__)
        on_meta = utils.has_meta_tensors(module)
        with self._collective("setup"):  # broadcasts of rank 0's weights or seed, the device mesh
            sharded = self._shard(module)
            if on_meta:
                utils.materialize_meta_module(sharded, self._materialize_device)
        self._sharded_modules.add(sharded)
        return sharded

    @property
    def _materialize_device(self) -> torch.device:
        return self.root_device

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward through the precision plugin; with sharded models it is a recorded collective."""
        if not self._sharded_modules:
            super().backward(tensor, module, *args, **kwargs)
            return
        # Gathers the resharded parameters again and reduce-scatters the gradients: every rank takes part.
        with self._collective("backward"):
            super().backward(tensor, module, *args, **kwargs)

    def setup_module_and_optimizers(
        self, module: Module, optimizers: Iterable[Optimizer]
    ) -> tuple[Module, list[Optimizer]]:
        """Shard the model, then point each optimizer at the sharded parameters that replaced its own."""
        optimizers = list(optimizers)
        names = utils.parameter_names(module)
        sharded = self.setup_module(module)
        for optimizer in optimizers:
            utils.rebind_optimizer(optimizer, names, sharded, type(self).__name__)
        return sharded, optimizers

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Accumulate unsharded gradients locally; the next synced backward reduce-scatters their sum."""
        if not enabled:
            return nullcontext()
        modules = utils.fsdp_modules(module)
        if not modules:
            return self._no_fsdp_modules_sync(module)
        return utils.gradient_sync_disabled(modules)

    def _no_fsdp_modules_sync(self, module: Module) -> AbstractContextManager:
        raise FabricTypeError(
            f"no_backward_sync({type(module).__name__}): this module is not sharded, so there is no gradient "
            "synchronisation to skip. Pass the model that fabric.setup() returned."
        )

    def clip_gradients_norm(
        self, module: Module, optimizer: Optimizer, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> Tensor:
        """Clip by the global norm over every rank's shards; returns that norm, the same on every rank."""
        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        check = error_if_nonfinite and not self.precision.has_loss_scaler
        return utils.clip_grad_norm(params, max_norm, norm_type, check)

    # -- checkpoints --------------------------------------------------------------------------------------
    def get_module_state_dict(self, module: Module) -> dict[str, Any]:
        """Sharded: this rank's DTensor shards. Full: the whole state on rank 0 (CPU), empty elsewhere; collective."""
        return utils.module_state_dict(module, full=self._state_dict_type == "full")

    def get_optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer state keyed by parameter names, laid out like `get_module_state_dict`; collective."""
        module = self._module_of(optimizer)
        if module is None:
            return optimizer.state_dict()
        return utils.optimizer_state_dict(module, optimizer, full=self._state_dict_type == "full")

    def _module_of(self, optimizer: Optimizer) -> Module | None:
        ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
        return next((m for m in self._sharded_modules if any(id(p) in ids for p in m.parameters())), None)

    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """Every rank takes part: a sharded folder (each rank its shards) or one full file written by rank 0."""
        if storage_options is not None:
            raise FabricTypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options=...): sharded checkpoints are written by "
                "torch.distributed.checkpoint, which takes no storage options. Drop storage_options."
            )
        if self.checkpoint_io.asynchronous and self._state_dict_type != "full":
            _refuse_remote_async(path, type(self).__name__)
        # Gathering the state and torch.distributed.checkpoint's planning are collectives of every rank.
        with self._collective("save"):
            self._save(path, state, filter)

    def _save(self, path: str | Path, state: dict[str, Any], filter: Any) -> None:
        from fabric.checkpoint import sharded as _sharded_checkpoint

        if self._state_dict_type == "full":
            _sharded_checkpoint.save_full(path, state, filter, self.checkpoint_io, self.is_global_zero)
        elif self.checkpoint_io.asynchronous:
            pinned = self.root_device.type == "cuda"
            self._async_saver.save(
                path, state, filter, self.checkpoint_io, self.global_rank, self.barrier, self._timeout, pinned
            )
        else:
            _sharded_checkpoint.save_sharded(path, state, filter, self.world_size, self.global_rank, self.barrier)

    def teardown(self) -> None:
        """Also free what background sharded saves kept (after waiting for the one in flight)."""
        try:
            super().teardown()
        finally:
            self._async_saver.close()

    def load_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any] | Module | Optimizer | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Every rank reads a sharded folder or a full file into `state` in place; returns what was not consumed."""
        from fabric.checkpoint import sharded as _sharded_checkpoint

        with self._collective("load"):  # torch.distributed.checkpoint plans the read with every rank
            return _sharded_checkpoint.load(path, state, strict, weights_only)


def _refuse_remote_async(path: str | Path, owner: str) -> None:
    from fabric.io import _fsspec

    if _fsspec.is_url(path):
        raise FabricValueError(
            f"{owner}.save_checkpoint({str(path)!r}) with AsyncCheckpointIO: background sharded saves write to a "
            "local directory only. Save to a local path, or drop AsyncCheckpointIO to write the URL synchronously."
        )
