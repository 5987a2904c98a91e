"""Set up a model for PipelineStrategy: cut it, keep this process's stages, and build their torch schedule.

Imports torch.distributed.pipelining, so the strategy imports this module only when a model is set up.
"""

from __future__ import annotations

import zlib
from typing import TYPE_CHECKING

import torch
from torch.nn import Module
from torch.optim import Optimizer

from fabric.strategies.pipeline import schedules
from fabric.strategies.pipeline.runtime import PipelineModule, ScheduleRunner, StageModule
from fabric.strategies.pipeline.stages import plan_stages, prune
from fabric.utilities.exceptions import FabricValueError

if TYPE_CHECKING:
    from fabric.strategies.pipeline.strategy import PipelineStrategy


def pipeline_module(strategy: PipelineStrategy, module: Module) -> PipelineModule:
    """Cut `module` into stages, keep this process's in place (the rest is dropped), and schedule them."""
    from torch.distributed.pipelining import PipelineStage

    plan = plan_stages(module, strategy._split_points, type(strategy).__name__)
    kind, count = strategy._schedule, len(plan.stages)
    size, rank = strategy.pipeline_size, strategy.pipeline_rank
    mine = schedules.local_stages(kind, count, size, rank)
    keeps = [set(plan.stages[index]) for index in mine]
    # The model itself drops what other processes run, so that its parameters, state dict and memory are this
    # process's share; each stage is then a copy of the cut modules that shares the whole ones with the model.
    prune(module, set().union(*keeps), plan.cut, in_place=True)
    device = strategy.root_device
    _materialize(module, device)
    shells = [prune(module, keep, plan.cut) for keep in keeps]
    precision = strategy.precision
    runs = [StageModule(shell, index, count, precision) for shell, index in zip(shells, mine, strict=True)]
    wrapped = [strategy._replicate(run) for run in runs]
    stages = [
        PipelineStage(run, index, count, device, group=strategy._group)
        for run, index in zip(wrapped, mine, strict=True)
    ]
    last_owner = schedules.local_stages_owner(kind, count, size, count - 1)
    runner = ScheduleRunner(
        schedule=None,
        microbatches=strategy._microbatches,
        holds_first=0 in mine,
        holds_last=count - 1 in mine,
        last_rank=strategy.data_parallel_rank * size + last_owner,
        group=strategy._group,
        device=device,
        precision=precision,
        loss_fn=strategy._loss_fn,
    )
    schedule_cls = schedules.schedule_class(kind)
    try:
        runner.schedule = schedule_cls(
            stages if kind.multi else stages[0],
            n_microbatches=strategy._microbatches,
            loss_fn=runner.loss,
            scale_grads=False,  # runner.loss divides by the number of microbatches
        )
    except ValueError as err:  # torch's own limits of a schedule (the same on every process)
        raise FabricValueError(
            f"{type(strategy).__name__}(schedule={kind.name!r}, microbatches={strategy._microbatches}) with "
            f"{count} stages on {size} pipeline processes: torch's schedule refuses this layout: {err} Choose "
            "microbatches (or a schedule) that it accepts."
        ) from err
    return PipelineModule(wrapped, runner)


def _materialize(module: Module, device: torch.device) -> None:
    """Move this process's share to its device; created under init_module(empty_init=True), allocate it there and
    initialise it with each submodule's reset_parameters() (the whole model never exists anywhere).

    Each submodule draws from its own seed, derived from its name: stages on different processes do not repeat
    each other's draws (equal layers would start equal), and the values do not depend on where the model is cut.
    """
    if not any(t.is_meta for t in (*module.parameters(), *module.buffers())):
        module.to(device)
        return
    module.to_empty(device=device)
    seed = torch.initial_seed()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        for name, submodule in module.named_modules():
            reset = getattr(submodule, "reset_parameters", None)
            if callable(reset):
                torch.manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
                reset()


def keep_local_parameters(optimizer: Optimizer, names: dict[int, str], module: Module, owner: str) -> None:
    """Let the optimizer hold this process's parameters only: those of other processes' stages are dropped (the
    module no longer has them), and those that FSDP replaced are swapped for their sharded form, by name."""
    current = dict(module.named_parameters())
    for group in optimizer.param_groups:
        kept = []
        for param in group["params"]:
            new = current.get(names.get(id(param), ""))
            if new is not None and new is not param and param in optimizer.state:
                raise RuntimeError(
                    f"{owner}(data_parallel='fsdp'): fabric.setup(model, {type(optimizer).__name__}) got an optimizer "
                    "that already has state, but sharding replaces the parameters it belongs to. Create the "
                    "optimizer after setup: model = fabric.setup_module(model), then "
                    "optimizer = fabric.setup_optimizers(make_optimizer(model.parameters()))."
                )
            if new is None:
                optimizer.state.pop(param, None)
            else:
                kept.append(new)
        group["params"] = kept
