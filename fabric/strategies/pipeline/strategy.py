"""PipelineStrategy: the model cut into stages by submodule name, run by a torch.distributed.pipelining schedule."""

from __future__ import annotations

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
from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies.parallel import DEFAULT_TIMEOUT, ParallelStrategy
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from torch.utils.data import DataLoader


class PipelineStrategy(ParallelStrategy):
    """Each process runs its stages of the model; `fabric.pipeline_step` runs forward and backward over microbatches.

    Args:
        split_points: the fully qualified names of the submodules where a new stage begins (stages =
            len(split_points) + 1).
        schedule: a torch schedule name, case-insensitive: GPipe, 1F1B (one stage per process), Interleaved1F1B,
            LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble (several stages per process).
        microbatches: how many equal parts each batch is split into.
        loss_fn: `loss_fn(output, target)` (or `loss_fn(output)` when no target is passed), averaged per microbatch.
        data_parallel_size: replicas of the whole pipeline that see different batches.
        data_parallel: how each stage is kept equal across the replicas: "ddp" (replicated, gradients all-reduced)
            or "fsdp" (FSDP2 `fully_shard` over the replicas: parameters, gradients and optimizer state sharded).
    """

    def __init__(
        self,
        split_points: list[str],
        schedule: str = "1F1B",
        microbatches: int = 4,
        loss_fn: Callable[..., Tensor] | None = None,
        data_parallel_size: int = 1,
        data_parallel: str = "ddp",
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
        # Imported here: `import fabric` pays nothing for a strategy that is not used.
        from fabric.strategies.pipeline import schedules
        from fabric.strategies.pipeline.stages import check_split_points

        name = type(self).__name__
        self._split_points = check_split_points(split_points, name)
        self._schedule = schedules.resolve(schedule, name)
        for argument, value in {"microbatches": microbatches, "data_parallel_size": data_parallel_size}.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise FabricValueError(f"{name}({argument}={value!r}): expected an int >= 1.")
        if not callable(loss_fn):
            raise FabricTypeError(
                f"{name}(loss_fn={loss_fn!r}): the last stage computes the loss of each microbatch, so the strategy "
                "needs the loss function: pass loss_fn=lambda output, target: ..."
            )
        if data_parallel not in ("ddp", "fsdp"):
            raise FabricValueError(
                f"{name}(data_parallel={data_parallel!r}): unknown way to keep the replicas of a stage equal. Use "
                "'ddp' (each replica holds the whole stage) or 'fsdp' (the stage's parameters sharded over them)."
            )
        self._data_parallel = data_parallel
        self._microbatches = microbatches
        self._loss_fn = loss_fn
        self._data_parallel_size = data_parallel_size
        self._group: Any = None  # the pipeline's process group (None: the default group)
        self._mesh: Any = None  # the (data_parallel, pipeline) device mesh, with several replicas

    # -- layout ---------------------------------------------------------------------------------------------
    @property
    def num_stages(self) -> int:
        """len(split_points) + 1."""
        return len(self._split_points) + 1

    @property
    def data_parallel_size(self) -> int:
        """Replicas of the pipeline that see different batches."""
        return self._data_parallel_size

    @property
    def pipeline_size(self) -> int:
        """Processes one replica of the pipeline spans."""
        return self.world_size // self._data_parallel_size

    @property
    def pipeline_rank(self) -> int:
        """This process's place in its pipeline (processes are laid out pipeline-major: neighbours are adjacent)."""
        return self.global_rank % self.pipeline_size

    @property
    def data_parallel_rank(self) -> int:
        """Which replica of the pipeline this process belongs to."""
        return self.global_rank // self.pipeline_size

    def _connect(self, **components: Any) -> None:
        """Refuse a device count the stages do not fit, and a loss-scaling precision, when Fabric(...) is built."""
        super()._connect(**components)
        self._check_layout()
        if self.precision.has_loss_scaler:
            raise FabricValueError(
                f"{type(self).__name__} with precision {getattr(self.precision, 'precision', '16-mixed')!r}: the "
                "pipeline schedule runs backward itself, so the loss scaler that float16 mixed precision needs "
                "never sees the loss. Use precision='bf16-mixed' (no scaler needed) or '32-true'."
            )

    def _check_layout(self) -> None:
        from fabric.strategies.pipeline import schedules

        world, dp, stages = self.world_size, self._data_parallel_size, self.num_stages
        per_rank = schedules.stages_per_rank(self._schedule, stages, world // dp) if world % dp == 0 else None
        if per_rank is not None:
            return
        kind = self._schedule
        if not kind.multi:
            rule = f"{kind.name} runs one stage per process, so it needs stages x data_parallel_size = {stages} x {dp}"
            need = f"{stages * dp} processes"
        elif kind.stages_per_rank:
            rule = f"{kind.name} runs {kind.stages_per_rank} stages per process, so it needs stages / "
            rule += f"{kind.stages_per_rank} x data_parallel_size = {stages} / {kind.stages_per_rank} x {dp}"
            need = f"{stages // kind.stages_per_rank * dp} processes (and an even number of stages)"
        else:
            rule = f"{kind.name} runs several stages per process, so stages ({stages}) must divide evenly over the "
            rule += f"processes of one pipeline (devices x num_nodes / data_parallel_size = {world} / {dp})"
            need = "a process count that does so"
        raise FabricValueError(
            f"{type(self).__name__}(split_points={len(self._split_points)} names, schedule={kind.name!r}, "
            f"data_parallel_size={dp}) on {world} processes: {rule}, but devices x num_nodes gives {world}. Use "
            f"{need}, or change split_points or data_parallel_size to fit {world} processes."
        )

    @property
    def distributed_sampler_kwargs(self) -> dict[str, int]:
        """Shard data by replica only: every stage of one pipeline reads the same batches."""
        return {"num_replicas": self._data_parallel_size, "rank": self.data_parallel_rank}

    def process_dataloader(self, dataloader: DataLoader, *, even_batches: bool = True) -> DataLoader:
        """A distributed sampler over the data-parallel replicas only."""
        kwargs = self.distributed_sampler_kwargs
        return self._shard_dataloader(dataloader, kwargs["num_replicas"], kwargs["rank"], even_batches)

    def setup_environment(self) -> None:
        """Join the process group, then make the pipeline's group when there are several replicas."""
        super().setup_environment()
        if self._data_parallel_size > 1 and self._mesh is None:
            from fabric.strategies.pipeline import mesh

            self._mesh = mesh.build_mesh(self)
            self._group = self._mesh["pipeline"].get_group()

    # -- modules and optimizers -----------------------------------------------------------------------------
    def module_init_context(self, empty_init: bool | None = None) -> AbstractContextManager:
        """Create the model on the CPU, or with empty_init=True on the meta device (setup allocates this process's
        stages on its device): never the whole model on every accelerator."""
        stack = ExitStack()
        stack.enter_context(torch.device("meta" if empty_init else "cpu"))
        stack.enter_context(self.precision.module_init_context())
        return stack

    def module_to_device(self, module: Module) -> None:
        """Nothing yet: setup moves only this process's stages, so the whole model never has to fit on one device."""

    def setup_module(self, module: Module) -> Module:
        """Keep only this process's stages of `module` (in place) and build their schedule."""
        import torch.distributed as dist

        from fabric.strategies.pipeline import build
        from fabric.strategies.pipeline.schedules import check_torch_for_backend
        from fabric.utilities.imports import _TORCH

        if dist.is_initialized():
            check_torch_for_backend(str(dist.get_backend(self._group)), _TORCH)
        with self._collective("setup"):  # with replicas, DDP broadcasts the first one's weights
            return build.pipeline_module(self, module)

    def setup_module_and_optimizers(
        self, module: Module, optimizers: Iterable[Optimizer]
    ) -> tuple[Module, list[Optimizer]]:
        """Set up the stages, then let each optimizer keep only the parameters this process still holds."""
        from fabric.strategies.pipeline import build

        optimizers = list(optimizers)
        names = {id(p): name for name, p in module.named_parameters()}  # fully_shard replaces the parameters
        model = self.setup_module(module)
        for optimizer in optimizers:
            build.keep_local_parameters(optimizer, names, module, type(self).__name__)
        return model, optimizers

    def _replicate(self, stage: Module) -> Module:
        """Keep a stage equal across the data-parallel replicas; with one replica there is nothing to keep."""
        if self._mesh is None:
            return stage
        from fabric.strategies.pipeline import mesh

        return mesh.replicate(stage, self._mesh, self.root_device, self._data_parallel)

    def pipeline_step(self, module: Module, inputs: tuple[Any, ...], target: Any) -> Tensor:
        """Run the schedule over the microbatches; the mean loss, the same on every stage of this pipeline."""
        runner = getattr(module, "_runner", None)
        if runner is None:
            raise FabricTypeError(
                f"fabric.pipeline_step({type(module).__name__}, ...): expected the model that fabric.setup() "
                "returned under PipelineStrategy. Pass that model."
            )
        with self._collective("pipeline_step"):
            return runner.step(inputs, target)

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Refused: the schedule runs backward itself, interleaved with forward, inside `fabric.pipeline_step`."""
        raise RuntimeError(
            f"fabric.backward(loss) under {type(self).__name__}: the pipeline schedule runs the backward passes "
            "itself, microbatch by microbatch on every stage, so there is no whole loss to call backward on. Replace "
            "model(x), loss_fn and fabric.backward(loss) with loss = fabric.pipeline_step(model, x, target=y)."
        )

    def clip_gradients_norm(
        self, module: Module, optimizer: Optimizer, max_norm: float, norm_type: float, error_if_nonfinite: bool
    ) -> Tensor:
        """Clip by the norm over the whole model's gradients (every stage's), the same on every stage."""
        import torch.distributed as dist

        self.precision.unscale_gradients(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        local = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type)
        if hasattr(local, "full_tensor"):  # FSDP: the norm over this stage's shards on all replicas
            local = local.full_tensor()
        local = local.to(self.root_device)
        if norm_type == float("inf"):
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=self._group)
            total = local
        else:
            # Sum the stages' p-th powers: replicas hold equal gradients, so only the pipeline's stages count.
            powered = local.double() ** norm_type
            dist.all_reduce(powered, group=self._group)
            total = (powered ** (1.0 / norm_type)).to(local.dtype)
        if error_if_nonfinite and not self.precision.has_loss_scaler and not torch.isfinite(total):
            raise RuntimeError(
                f"fabric.clip_gradients(max_norm={max_norm}): the total gradient norm over all stages is "
                f"{total.item()}, so the gradients cannot be clipped. Find where the loss or gradients become inf or "
                "nan, or pass error_if_nonfinite=False to clip anyway."
            )
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with torch.no_grad():
            for param in params:
                grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
                grad.mul_(coefficient.to(grad.device, grad.dtype))
        return total

    # -- checkpoints --------------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """One sharded (DCP) checkpoint: each process writes its stages under the whole model's names, so it loads
        into the whole model in one process, or into another split."""
        from fabric.checkpoint import sharded

        if storage_options is not None:
            raise FabricTypeError(
                f"{type(self).__name__}.save_checkpoint(storage_options=...): pipeline checkpoints are written by "
                "torch.distributed.checkpoint, which takes no storage options. Drop storage_options."
            )
        with self._collective("save"):
            sharded.save_sharded(path, state, filter, self.world_size, self.global_rank, self.barrier)

    def load_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any] | Module | Optimizer | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """Each process reads its stages' entries of a sharded checkpoint, whichever split or replicas saved it."""
        from fabric.checkpoint import sharded
        from fabric.strategies.pipeline import checkpoint

        if state is None or not sharded.is_sharded_checkpoint(path):
            checkpoint.refuse_full_file(path, state, type(self).__name__)
            return super().load_checkpoint(path, state, strict, weights_only)
        if not isinstance(state, dict):
            raise FabricTypeError(
                f"load({str(path)!r}, {type(state).__name__}) under {type(self).__name__}: a pipeline loads a "
                "checkpoint by its entries. Pass a dict such as {'model': model, 'optimizer': optimizer}."
            )
        with self._collective("load"):
            return checkpoint.load(path, state, strict, weights_only)

    def no_backward_sync(self, module: Module, enabled: bool) -> AbstractContextManager:
        """Accumulate this replica's gradients without averaging them over the replicas (none with one replica)."""
        runner = getattr(module, "_runner", None)
        if runner is None:
            raise FabricTypeError(
                f"no_backward_sync({type(module).__name__}): expected the model that fabric.setup() returned under "
                f"{type(self).__name__}. Pass that model."
            )
        return runner.unsynced() if enabled and self._mesh is not None else nullcontext()
