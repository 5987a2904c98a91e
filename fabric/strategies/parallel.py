"""Base for strategies with one process per device: ranks, the process group, collectives, launchers."""

from __future__ import annotations

import os
import weakref
from contextlib import AbstractContextManager
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from fabric.accelerators.accelerator import Accelerator
from fabric.diagnostics import track as _diagnostics
from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies.strategy import Strategy
from fabric.utilities import distributed as _dist
from fabric.utilities.direct_calls import direct_group as _direct_group
from fabric.utilities.exceptions import FabricValueError

if TYPE_CHECKING:
    from torch.utils.data import DataLoader

# torch's own default for collectives; long enough for slow first steps, finite so nothing hangs forever.
DEFAULT_TIMEOUT = timedelta(minutes=30)
_START_METHODS = ("popen", "spawn", "fork", "forkserver")


class ParallelStrategy(Strategy):
    """One process per device, joined in torch.distributed's default process group."""

    requires_launch = True

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
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        if start_method not in _START_METHODS:
            raise FabricValueError(
                f"{type(self).__name__}(start_method={start_method!r}): unknown start method. "
                f"Use one of {', '.join(_START_METHODS)}."
            )
        self.parallel_devices = parallel_devices
        self._cluster_environment = cluster_environment
        self._process_group_backend = process_group_backend
        self._timeout = timeout or DEFAULT_TIMEOUT
        self._start_method = start_method
        self.num_nodes = num_nodes
        self._owns_process_group = False

    def _connect(
        self,
        *,
        cluster_environment: ClusterEnvironment,
        parallel_devices: list[torch.device],
        num_nodes: int,
        **components: Any,
    ) -> None:
        """Fill in what is missing, then choose the launcher from the environment and start method."""
        super()._connect(
            cluster_environment=cluster_environment,
            parallel_devices=parallel_devices,
            num_nodes=num_nodes,
            **components,
        )
        self._cluster_environment = self._cluster_environment or cluster_environment
        self.parallel_devices = self.parallel_devices or parallel_devices
        self.num_nodes = num_nodes
        self._launcher = self._make_launcher()

    def _make_launcher(self) -> Any:
        env = self.cluster_environment
        if env is None or env.creates_processes_externally:
            return None
        layout = (self.num_processes, self.num_nodes, env.node_rank(), env.main_address, env.main_port)
        if self._start_method == "popen":
            from fabric.strategies.launchers.subprocess_script import SubprocessScriptLauncher

            return SubprocessScriptLauncher(*layout)
        from fabric.strategies.launchers.multiprocessing import MultiProcessingLauncher

        return MultiProcessingLauncher(*layout, start_method=self._start_method)

    # -- who am I ---------------------------------------------------------------------------------
    @property
    def cluster_environment(self) -> ClusterEnvironment | None:
        """Where ranks, world size and the rendezvous address come from."""
        return self._cluster_environment

    @property
    def num_processes(self) -> int:
        """Processes on this machine."""
        return len(self.parallel_devices) if self.parallel_devices else 0

    @property
    def local_rank(self) -> int:
        """From the environment (set by our launcher or the external one)."""
        return self.cluster_environment.local_rank() if self.cluster_environment else 0

    @property
    def node_rank(self) -> int:
        """From the environment."""
        return self.cluster_environment.node_rank() if self.cluster_environment else 0

    @property
    def global_rank(self) -> int:
        """The environment's, or node_rank * processes per node + local_rank."""
        rank = self.cluster_environment.global_rank() if self.cluster_environment else None
        return rank if rank is not None else self.node_rank * self.num_processes + self.local_rank

    @property
    def world_size(self) -> int:
        """The environment's, or processes per node x nodes."""
        size = self.cluster_environment.world_size() if self.cluster_environment else None
        return size if size is not None else self.num_processes * self.num_nodes

    @property
    def root_device(self) -> torch.device:
        """The device of this local rank."""
        if not self.parallel_devices:
            return torch.device("cpu")
        return self.parallel_devices[self.local_rank]

    @property
    def process_group_backend(self) -> str:
        """nccl for CUDA, gloo otherwise, unless the user chose."""
        if self._process_group_backend:
            return self._process_group_backend
        return "nccl" if self.root_device.type == "cuda" else "gloo"

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """How to shard a dataset across processes."""
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    # -- process group --------------------------------------------------------------------------------
    def setup_environment(self) -> None:
        """Select the device and join (or reuse) the default process group."""
        if self.accelerator is not None:
            self.accelerator.setup_device(self.root_device)
        if self.root_device.type == "cpu":
            _share_cpu_threads(self.num_processes)
        from fabric.strategies.launchers._process import die_with_parent, report_failures_to_parent

        report_failures_to_parent(self.local_rank, self.global_rank)
        if self.cluster_environment is not None and self.cluster_environment.launcher_is_parent:
            die_with_parent()  # torchrun's workers outlive a killed agent otherwise (`fabric run` sets it earlier)
        if dist.is_initialized():
            self._check_existing_group()
            self._attach_health(_dist.default_store())
            return
        env = self.cluster_environment
        assert env is not None, "connector always sets a cluster environment"
        _import_before_group_exists()
        _diagnostics.prepare_torch_env(self.process_group_backend)  # torch reads these when the group starts
        store = _dist.init_process_group(
            self.process_group_backend,
            env.main_address,
            env.main_port,
            self.world_size,
            self.global_rank,
            self._timeout,
            # Binds NCCL's communicator to this GPU at once, instead of torch guessing the device at the first
            # collective (and warning that a wrong guess can hang).
            device_id=self.root_device if self.root_device.type == "cuda" else None,
        )
        self._owns_process_group = True
        # The records and the preemption keys live in the default group's store (torch prefixes its keys), where
        # the timeout messages read them.
        default_store = _dist.default_store()
        self._attach_health(default_store if default_store is not None else store)

    def _attach_health(self, store: Any) -> None:
        """One health thread for the group, the recorder it publishes, and this strategy's preemption decisions.

        fabric/health orders this rank's exit too (publish how it ended, stop the thread, destroy a group fabric
        created), whether or not the user tears down.
        """
        from fabric.health.attach import attach_health

        # Nothing else ends the other ranks when one fails unless fabric launched them or an agent supervises them.
        env = self.cluster_environment
        unsupervised = self.launcher is None and not (env is not None and env.ends_job_on_failure)
        health = attach_health(
            store, self.global_rank, self.world_size, self._timeout, unsupervised, self._owns_process_group
        )
        recorder = _diagnostics.start_recording()
        if health is not None and recorder is not None:
            health.adopt(recorder)
        self.preemption.attach(health)

    def _check_existing_group(self) -> None:
        if dist.get_world_size() != self.world_size or dist.get_rank() != self.global_rank:
            raise RuntimeError(
                f"{type(self).__name__}: torch.distributed is already initialised with world size "
                f"{dist.get_world_size()} and rank {dist.get_rank()}, but the flags give world size "
                f"{self.world_size} and rank {self.global_rank}. Make devices/num_nodes match the existing "
                "process group."
            )

    def teardown(self) -> None:
        """Destroy the process group if this strategy created it (after background saves that use it finished)."""
        try:
            self.checkpoint_io.wait()
        finally:
            self.preemption.detach()
            if self._owns_process_group and dist.is_initialized():
                from fabric.health.attach import release_health

                _diagnostics.stop_recording()  # the peers see "exited" before the connections drop
                release_health()  # its thread uses the group's store
                dist.destroy_process_group()
            self._owns_process_group = False
            super().teardown()

    # -- collectives ----------------------------------------------------------------------------------
    @property
    def _forward_is_collective(self) -> bool:
        # Whether every forward pass communicates (sharded parameters are gathered), so that all ranks must run the
        # same number of batches even in evaluation; such strategies refuse loaders with uneven batches.
        return False

    def process_dataloader(self, dataloader: DataLoader, *, even_batches: bool = True) -> DataLoader:
        """Give each process its shard of the data through a distributed sampler (unpadded if not even_batches)."""
        return self._shard_dataloader(dataloader, self.world_size, self.global_rank, even_batches)

    def _shard_dataloader(self, dataloader: DataLoader, replicas: int, rank: int, even_batches: bool) -> DataLoader:
        from fabric.utilities.data import inject_distributed_sampler
        from fabric.utilities.seed import current_seed_config

        seed, _ = current_seed_config()
        if even_batches:
            return inject_distributed_sampler(dataloader, replicas, rank, seed=seed or 0)
        if self._forward_is_collective and replicas > 1:
            raise FabricValueError(
                f"setup_dataloaders(even_batches=False): {type(self).__name__} communicates in every forward pass "
                "(it gathers the sharded parameters), so every rank must run the same number of batches, but "
                "even_batches=False gives some ranks one batch fewer when the samples do not divide evenly. Keep "
                "even_batches=True here, or evaluate with strategy='ddp' or on one device."
            )
        from fabric.utilities.exact_sampler import inject_exact_sampler

        return inject_exact_sampler(dataloader, replicas, rank, seed=seed or 0)

    # The collectives below record themselves through `_diagnostics.enter/failed/leave` (plain calls, no object per
    # call): what a healthy collective pays on top of the raw torch call is a few attribute assignments.
    def barrier(self, name: str | None = None) -> None:
        """Wait for every process (no-op before the group exists)."""
        if not dist.is_initialized():
            return
        seq = 0
        try:
            seq = _diagnostics.enter("barrier")
            if self._live_group_uses_nccl:
                dist.barrier(device_ids=[self.root_device.index])
            else:
                direct = _direct_group()
                direct.barrier() if direct is not None else dist.barrier()
        except RuntimeError as err:
            _diagnostics.failed(err, "barrier", seq, self._timeout_words)
            raise
        finally:
            _diagnostics.leave(seq)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Send a picklable object from `src` to every process."""
        if not dist.is_initialized():
            return obj
        holder = [obj]
        with _diagnostics.collective("broadcast", self._timeout_words, (f"src={src}",)):
            dist.broadcast_object_list(holder, src=src, device=self._object_device)
        return holder[0]

    @property
    def _object_device(self) -> torch.device | None:
        return self.root_device if self._live_group_uses_nccl else None

    @property
    def _live_group_uses_nccl(self) -> bool:
        # The group that exists decides, not the configured name: a group made by the user or torchrun may use
        # another backend, and a mixed one ("cpu:gloo,cuda:nccl") sends CUDA tensors through NCCL. Decided once per
        # group (a weak reference: the group must die with destroy_process_group), not on every barrier; a CPU
        # process never uses NCCL (its root device is fixed once the processes exist).
        cached = self.__dict__.get("_nccl_decision")
        if cached is not None and (cached[0] is None or cached[0]() is dist.group.WORLD):
            return cached[1]
        if self.root_device.type != "cuda":
            self.__dict__["_nccl_decision"] = (None, False)
            return False
        world = dist.group.WORLD
        uses_nccl = "nccl" in str(dist.get_backend())
        self.__dict__["_nccl_decision"] = (weakref.ref(world), uses_nccl)
        return uses_nccl

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Stack the tensors of all processes along a new first dimension (one collective; equal shapes)."""
        if not dist.is_initialized():
            return tensor
        seq = 0
        try:
            seq = _diagnostics.enter("all_gather", (tensor,), group)
            if sync_grads:
                return _dist.all_gather(tensor, group=group, sync_grads=True)
            return _dist.gather_flat(tensor, group)  # the common call, one Python call shorter
        except RuntimeError as err:
            _diagnostics.failed(err, "all_gather", seq, self._timeout_words)
            raise
        finally:
            _diagnostics.leave(seq)

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str = "mean") -> Tensor:
        """Reduce across processes; the input is left unchanged."""
        if not dist.is_initialized():
            _dist.check_reduce_op(reduce_op)
            return tensor
        seq = 0
        try:
            seq = _diagnostics.enter("all_reduce", (tensor, reduce_op), group)
            return _dist.all_reduce(tensor, reduce_op, group=group)
        except RuntimeError as err:
            _diagnostics.failed(err, "all_reduce", seq, self._timeout_words)
            raise
        finally:
            _diagnostics.leave(seq)

    def _collective(
        self, operation: str, args: tuple[Any, ...] = (), group: Any = None
    ) -> AbstractContextManager[None]:
        """Record the collective for hang diagnosis, compare it across ranks in debug mode, explain its failure.

        `args` are what must match on every rank (FABRIC_DEBUG_COLLECTIVES): tensors by dtype and shape.
        """
        return _diagnostics.collective(operation, self._timeout_words, args, group)

    def _timeout_words(self) -> tuple[str, str]:
        """How long a collective waits and the call that sets it, for a failure's message (made only then)."""
        if self._owns_process_group:
            return str(self._timeout), f"{type(self).__name__}(timeout=...)"
        # The group is someone else's: its timeout was set where it was created, not by this strategy.
        return "the process group's timeout", "torch.distributed.init_process_group(timeout=...)"


def _share_cpu_threads(num_processes: int) -> None:
    """Give each CPU rank its share of the cores; N ranks with all cores each thrash (torchrun does the same)."""
    if "OMP_NUM_THREADS" in os.environ or num_processes <= 1:
        return
    # The cores this process may run on (a container's or scheduler's CPU set), not all of the machine's:
    # Lightning Fabric counts the same way, so both pick the same thread count and give the same numbers.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    torch.set_num_threads(max(1, cores // num_processes))


def _import_before_group_exists() -> None:
    """Import torch.distributed.nn before the group exists, so destroying the group frees it.

    Its functions take `group=group.WORLD` as a default argument, evaluated at import. DDP imports the module
    lazily, after the group exists, so those defaults would pin the group (and its gloo worker threads) until
    interpreter finalisation, where a worker still releasing a finished collective's tensors aborts the process
    ("terminate called without an active exception").
    """
    import torch.distributed.nn.functional  # noqa: F401
