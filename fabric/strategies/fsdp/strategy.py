"""Fully Sharded Data Parallel (FSDP2, `torch.distributed.fsdp.fully_shard`): parameters, gradients and
optimizer state are split across processes."""

from __future__ import annotations

from collections.abc import Callable, Collection
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module

from fabric.accelerators.accelerator import Accelerator
from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.fsdp import mixed_precision_policy
from fabric.precision.precision import Precision
from fabric.strategies.fsdp import utils
from fabric.strategies.fsdp.base import _FullyShardedStrategy
from fabric.strategies.parallel import DEFAULT_TIMEOUT
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

# A set of layer classes, or a function telling whether a submodule gets its own fully_shard / checkpoint.
ModulePolicy = Collection[type[Module]] | Callable[[Module], bool]
# Lightning's names for FSDP1 sharding strategies, as fully_shard settings: reshard after forward, hybrid mesh.
_SHARDING_STRATEGIES = {"FULL_SHARD": (True, False), "SHARD_GRAD_OP": (False, False), "HYBRID_SHARD": (True, True)}


class FSDPStrategy(_FullyShardedStrategy):
    """Shards parameters, gradients and optimizer state across processes with FSDP2 (`fully_shard`)."""

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
        auto_wrap_policy: ModulePolicy | None = None,
        activation_checkpointing_policy: ModulePolicy | None = None,
        cpu_offload: bool = False,
        mixed_precision: MixedPrecisionPolicy | None = None,
        sync_module_states: bool = False,
        state_dict_type: str = "sharded",
        device_mesh: tuple[int, int] | DeviceMesh | None = None,
        sharding_strategy: str = "FULL_SHARD",
        reshard_after_forward: bool | int | None = None,
        **fully_shard_kwargs: Any,
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
            state_dict_type=state_dict_type,
        )
        name = type(self).__name__
        self._auto_wrap_policy = _as_predicate(auto_wrap_policy, "auto_wrap_policy", name)
        checkpointing = activation_checkpointing_policy
        self._checkpointing_policy = _as_predicate(checkpointing, "activation_checkpointing_policy", name)
        if sharding_strategy not in _SHARDING_STRATEGIES:
            raise FabricValueError(
                f"{name}(sharding_strategy={sharding_strategy!r}): not supported by fully_shard. Use one of "
                f"{', '.join(_SHARDING_STRATEGIES)} (for no sharding at all, use strategy='ddp')."
            )
        default_reshard, self._hybrid = _SHARDING_STRATEGIES[sharding_strategy]
        self._reshard_after_forward = default_reshard if reshard_after_forward is None else reshard_after_forward
        _check_mesh_argument(device_mesh, self._hybrid, name)
        self._mesh_argument = device_mesh
        self.cpu_offload = cpu_offload
        self._mixed_precision = mixed_precision
        self._sync_module_states = sync_module_states
        self._fully_shard_kwargs = fully_shard_kwargs

    def _connect(self, **components: Any) -> None:
        """A mesh given as sizes must cover exactly the processes of this run."""
        super()._connect(**components)
        if not isinstance(self._mesh_argument, tuple):
            return
        replicate, shard = self._mesh_argument
        if replicate * shard != self.world_size:
            raise FabricValueError(
                f"{type(self).__name__}(device_mesh={self._mesh_argument}): {replicate} replicas x {shard} shards "
                f"= {replicate * shard} processes, but this run has {self.world_size} (devices x num_nodes). "
                "Choose sizes whose product is the number of processes."
            )

    @property
    def process_group_backend(self) -> str:
        """With CPU offload on GPUs, gloo for CPU tensors next to NCCL: the gradient norm of offloaded shards is
        reduced on the CPU, which NCCL cannot do."""
        backend = super().process_group_backend
        if self.cpu_offload and self._process_group_backend is None and backend == "nccl":
            return "cpu:gloo,cuda:nccl"
        return backend

    @property
    def mixed_precision_policy(self) -> MixedPrecisionPolicy | None:
        """The policy given to fully_shard: the explicit `mixed_precision`, else the one the precision implies."""
        return self._mixed_precision or mixed_precision_policy(self.precision.precision)

    def _build_device_mesh(self) -> DeviceMesh:
        from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

        if isinstance(self._mesh_argument, DeviceMesh):
            return self._mesh_argument
        shape = self._mesh_argument
        if shape is None and self._hybrid:
            shape = (self.num_nodes, self.world_size // self.num_nodes)
        if shape is None:
            return init_device_mesh(self.root_device.type, (self.world_size,), mesh_dim_names=("shard",))
        return init_device_mesh(self.root_device.type, shape, mesh_dim_names=("replicate", "shard"))

    @property
    def _materialize_device(self) -> torch.device:
        # Offloaded shards live in CPU memory; allocating them on the GPU would undo the offloading.
        return torch.device("cpu") if self.cpu_offload else self.root_device

    def _shard(self, module: Module) -> Module:
        """Checkpoint activations, fully_shard each submodule the policy picks (innermost first), then the root."""
        from torch.distributed._composable import checkpoint
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        if self._sync_module_states and not utils.has_meta_tensors(module):
            module.to(self.root_device)
            utils.broadcast_module_states(module)
        if self._checkpointing_policy is not None:
            for submodule in list(module.modules()):
                if submodule is not module and self._checkpointing_policy(submodule):
                    checkpoint(submodule)
        kwargs: dict[str, Any] = {"mesh": self.device_mesh, "reshard_after_forward": self._reshard_after_forward}
        if self.mixed_precision_policy is not None:
            kwargs["mp_policy"] = self.mixed_precision_policy
        if self.cpu_offload:
            # Pinned memory needs a GPU driver; on a CPU-only run the shards simply stay in (unpinned) memory.
            kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=self.root_device.type == "cuda")
        kwargs.update(self._fully_shard_kwargs)
        if self._auto_wrap_policy is not None:
            # named_modules is parent-before-child; reversed, every layer is sharded before the layers around it.
            for submodule in reversed(list(module.modules())):
                if submodule is not module and self._auto_wrap_policy(submodule):
                    fully_shard(submodule, **kwargs)
        fully_shard(module, **kwargs)
        return module


def _as_predicate(policy: ModulePolicy | None, argument: str, owner: str) -> Callable[[Module], bool] | None:
    """A set of layer classes becomes an isinstance test; a function is used as it is."""
    if policy is None:
        return None
    if isinstance(policy, Collection) and not isinstance(policy, (str, bytes)):
        classes = tuple(policy)
        if classes and all(isinstance(c, type) and issubclass(c, Module) for c in classes):
            return lambda module: isinstance(module, classes)
    elif callable(policy) and not isinstance(policy, type):
        return policy
    raise FabricTypeError(
        f"{owner}({argument}={policy!r}): expected a set of layer classes such as {{nn.TransformerEncoderLayer}} "
        "or a function taking a submodule and returning True for those that should get their own unit."
    )


def _check_mesh_argument(mesh: Any, hybrid: bool, owner: str) -> None:
    if mesh is None or (not isinstance(mesh, tuple) and type(mesh).__name__ == "DeviceMesh"):
        return
    if isinstance(mesh, tuple) and len(mesh) == 2 and all(isinstance(s, int) and s > 0 for s in mesh):
        return
    raise FabricTypeError(
        f"{owner}(device_mesh={mesh!r}): expected a DeviceMesh or a (replicas, shards) tuple of positive ints, "
        "such as (2, 8) for two nodes of eight GPUs (hybrid sharding)."
    )
