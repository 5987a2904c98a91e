"""Tensor parallelism plus FSDP2 on a 2-D device mesh: the user's `parallelize_fn` decides what goes where."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
from torch.nn import Module

from fabric.accelerators.accelerator import Accelerator
from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies.fsdp import utils
from fabric.strategies.fsdp.base import _FullyShardedStrategy
from fabric.strategies.parallel import DEFAULT_TIMEOUT
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.utils.data import DataLoader

MESH_DIM_NAMES = ("data_parallel", "tensor_parallel")


class ModelParallelStrategy(_FullyShardedStrategy):
    """Builds a (data_parallel, tensor_parallel) mesh and hands the model and mesh to `parallelize_fn`."""

    def __init__(
        self,
        parallelize_fn: Callable[[Module, DeviceMesh], Module],
        data_parallel_size: int | str = "auto",
        tensor_parallel_size: int | str = "auto",
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
            state_dict_type=state_dict_type,
        )
        name = type(self).__name__
        if not callable(parallelize_fn):
            raise FabricTypeError(
                f"{name}(parallelize_fn={parallelize_fn!r}): expected a function (module, device_mesh) -> module "
                "that applies tensor parallelism and fully_shard."
            )
        sizes = {"data_parallel_size": data_parallel_size, "tensor_parallel_size": tensor_parallel_size}
        for argument, size in sizes.items():
            if size != "auto" and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
                raise FabricValueError(f"{name}({argument}={size!r}): expected 'auto' or an int >= 1.")
        self._parallelize_fn = parallelize_fn
        self._requested_sizes = (data_parallel_size, tensor_parallel_size)
        self._sizes: tuple[int, int] | None = None

    def _connect(self, **components: Any) -> None:
        """Resolve 'auto' sizes against the number of processes; refuse sizes that do not multiply to it."""
        super()._connect(**components)
        self._sizes = self._resolve_sizes()

    def _resolve_sizes(self) -> tuple[int, int]:
        dp, tp = self._requested_sizes
        world = self.world_size
        if dp == "auto" and tp == "auto":
            # Lightning's default: tensor parallel inside a machine (fast links), data parallel across machines.
            dp, tp = self.num_nodes, world // self.num_nodes
        elif dp == "auto":
            dp = world // tp if isinstance(tp, int) and world % tp == 0 else 0
        elif tp == "auto":
            tp = world // dp if isinstance(dp, int) and world % dp == 0 else 0
        assert isinstance(dp, int) and isinstance(tp, int)
        if dp * tp != world or dp < 1 or tp < 1:
            requested_dp, requested_tp = self._requested_sizes
            raise FabricValueError(
                f"{type(self).__name__}(data_parallel_size={requested_dp!r}, tensor_parallel_size={requested_tp!r}): "
                f"the mesh must hold all {world} processes (devices x num_nodes), but these sizes cannot multiply "
                f"to {world}. Choose sizes whose product is {world}."
            )
        return dp, tp

    @property
    def data_parallel_size(self) -> int:
        """Replicas that see different batches."""
        return self._mesh_sizes[0]

    @property
    def tensor_parallel_size(self) -> int:
        """Processes that split each layer and see the same batches."""
        return self._mesh_sizes[1]

    @property
    def _mesh_sizes(self) -> tuple[int, int]:
        if self._sizes is None:
            self._sizes = self._resolve_sizes()
        return self._sizes

    @property
    def data_parallel_rank(self) -> int:
        """This process's index along the data-parallel dimension (the mesh is laid out row-major)."""
        return self.global_rank // self.tensor_parallel_size

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Shard data by data-parallel rank: the tensor-parallel ranks of one replica read the same batches."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    def process_dataloader(self, dataloader: DataLoader, *, even_batches: bool = True) -> DataLoader:
        """A distributed sampler over the data-parallel replicas only."""
        kwargs = self.distributed_sampler_kwargs
        return self._shard_dataloader(dataloader, kwargs["num_replicas"], kwargs["rank"], even_batches)

    def _build_device_mesh(self) -> DeviceMesh:
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(self.root_device.type, self._mesh_sizes, mesh_dim_names=MESH_DIM_NAMES)

    def _shard(self, module: Module) -> Module:
        """Call the user's parallelize_fn; without fully_shard, data-parallel replicas would drift apart."""
        name = type(self).__name__
        result = self._parallelize_fn(module, self.device_mesh)
        if not isinstance(result, Module):
            raise FabricTypeError(
                f"{name}(parallelize_fn={getattr(self._parallelize_fn, '__name__', '...')}) returned "
                f"{type(result).__name__}, not a module. Return the module it parallelized."
            )
        if self.data_parallel_size > 1 and not utils.fsdp_modules(result):
            raise RuntimeError(
                f"{name}(data_parallel_size={self.data_parallel_size}): parallelize_fn applied no fully_shard, so "
                "gradients would not be averaged across the data-parallel replicas and they would drift apart. "
                "Call fully_shard(module, mesh=device_mesh['data_parallel']) in parallelize_fn."
            )
        return result

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Skip the data-parallel reduction while accumulating; nothing to skip with tensor parallelism only."""
        if enabled and not utils.fsdp_modules(module):
            return nullcontext()
        return super().no_backward_sync(module, enabled)
