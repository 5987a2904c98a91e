"""What runs a pipeline step: the module each stage calls, and the module `fabric.setup` returns, which owns the
schedule and refuses a plain forward."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from fabric.strategies.pipeline.stages import MODEL_SHAPES
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from fabric.precision.precision import Precision


class StageModule(nn.Module):
    """One stage: the cut model's own forward, or its children in order for an nn.ModuleList or nn.ModuleDict."""

    def __init__(self, stage: nn.Module, index: int, num_stages: int, precision: Precision) -> None:
        super().__init__()
        self.stage = stage
        self._chain = isinstance(stage, (nn.ModuleList, nn.ModuleDict))
        self._where = f"stage {index} of {num_stages} ({type(stage).__name__})"
        self._precision = precision

    def forward(self, *args: Any) -> Any:
        with self._precision.forward_context():
            try:
                return self._chained(*args) if self._chain else self.stage(*args)
            except TypeError as err:
                if "NoneType" not in str(err):
                    raise
                # The usual sign of a forward that calls a submodule of another stage (set to None here).
                raise RuntimeError(
                    f"PipelineStrategy: the forward of {self._where} failed: {err}. A stage runs the model's own "
                    "forward with the submodules of the other stages set to None, so the model must be "
                    f"{MODEL_SHAPES}. Rewrite forward that way, or pass an nn.Sequential."
                ) from err

    def _chained(self, *args: Any) -> Any:
        output: Any = args
        for child in self.stage._modules.values():
            output = child(*args)  # type: ignore[misc]  # a container's entries are never None
            args = output if isinstance(output, tuple) else (output,)
        return output


class PipelineModule(nn.Module):
    """What `fabric.setup` returns under PipelineStrategy: this process's stages and their schedule.

    A forward call is refused (a stage alone computes nothing the user asked for); `fabric.pipeline_step` runs the
    schedule over the microbatches.
    """

    def __init__(self, stages: list[nn.Module], runner: ScheduleRunner) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self._runner = runner

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            "model(...) under PipelineStrategy: this process holds only its stages of the model, so a forward "
            "call alone cannot compute the model's output. Call loss = fabric.pipeline_step(model, x, target=y), "
            "which runs forward and backward over the microbatches on every stage."
        )


class ScheduleRunner:
    """Runs a torch schedule for this process's stages and shares the last stage's mean loss."""

    def __init__(
        self,
        schedule: Any,
        microbatches: int,
        holds_first: bool,
        holds_last: bool,
        last_rank: int,
        group: Any,
        device: torch.device,
        precision: Precision,
        loss_fn: Callable[..., Tensor],
    ) -> None:
        self.schedule = schedule
        self.microbatches = microbatches
        self.holds_first, self.holds_last = holds_first, holds_last
        self._last_rank, self._group, self._device = last_rank, group, device
        self._precision = precision
        self._loss_fn = loss_fn
        self._with_target = True

    @contextmanager
    def unsynced(self) -> Iterator[None]:
        """Run the stages without their DDP wrappers: torch's stages all-reduce a DDP stage at its last microbatch,
        and a plain module is never synchronised."""
        stages = self.schedule._stages if hasattr(self.schedule, "_stages") else [self.schedule._stage]
        replicated = [
            (stage, stage.submod) for stage in stages if isinstance(getattr(stage.submod, "module", None), nn.Module)
        ]
        for stage, wrapper in replicated:
            stage.submod = wrapper.module
        try:
            yield
        finally:
            for stage, wrapper in replicated:
                stage.submod = wrapper

    def loss(self, output: Any, target: Any) -> Tensor:
        """The schedule's loss function: the user's (without target if none) on outputs in the default dtype, over
        the number of microbatches, so that the gradients add up to those of the batch's mean loss."""
        output = self._precision.convert_output(output)
        loss = self._loss_fn(output, target) if self._with_target else self._loss_fn(output)
        # Scaled here rather than by the schedule (scale_grads=False): torch divides the whole `.grad` after each
        # step, which would shrink gradients accumulated over earlier steps again (no_backward_sync).
        return loss / self.microbatches

    def step(self, inputs: tuple[Any, ...], target: Any) -> Tensor:
        """Forward and backward over the microbatches (forward only under torch.no_grad()); the mean loss, as a
        0-dim float tensor on every rank."""
        check_batch(inputs, target, self.microbatches)
        self._with_target = target is not None
        if target is None:  # torch's schedules index a target per microbatch: give them a stand-in
            target = torch.zeros(_batch_size(inputs), device=self._device)
        args = self._precision.convert_input(inputs) if self.holds_first else ()
        losses: list[Tensor] = []
        target = target if self.holds_last else None
        if torch.is_grad_enabled():
            self.schedule.step(*args, target=target, losses=losses, return_outputs=False)
        else:  # under torch.no_grad(): forward only, for evaluation
            self.schedule.eval(*args, target=target, losses=losses)
        if self.holds_last:
            loss = torch.stack([value.detach().float() for value in losses]).sum()  # each is already divided
        else:
            loss = torch.zeros((), dtype=torch.float32, device=self._device)
        if dist.get_world_size(self._group) > 1:
            dist.broadcast(loss, src=self._last_rank, group=self._group)
        return loss


def check_batch(inputs: tuple[Any, ...], target: Any, microbatches: int) -> None:
    """Every rank sees the same batch, so every rank raises here alike: no rank waits for one that failed."""
    if not inputs:
        raise FabricTypeError(
            "fabric.pipeline_step(model): no inputs were passed. Pass the batch: fabric.pipeline_step(model, x, "
            "target=y)."
        )
    tensors = [("input", t) for t in inputs if isinstance(t, Tensor)]
    if isinstance(target, Tensor):
        tensors.append(("target", target))
    if not tensors:
        raise FabricTypeError(
            "fabric.pipeline_step(model, ...): no input is a tensor, so there is no batch to split into "
            "microbatches. Pass the batch as tensors whose first dimension is the batch."
        )
    for what, tensor in tensors:
        size = tensor.shape[0] if tensor.dim() else 0
        if size == 0 or size % microbatches:
            raise FabricValueError(
                f"fabric.pipeline_step(model, ...): the {what} has batch size {size} (first dimension), which does "
                f"not divide into PipelineStrategy(microbatches={microbatches}) equal microbatches. Use a batch size "
                f"that is a multiple of {microbatches} (DataLoader(drop_last=True) drops a smaller last batch), or "
                "choose microbatches to divide it."
            )


def _batch_size(inputs: tuple[Any, ...]) -> int:
    return next(t.shape[0] for t in inputs if isinstance(t, Tensor))
