"""The pipeline schedules by name, how many stages each puts on a process, and which stages a process runs.

torch.distributed.pipelining is imported only in `schedule_class`, when a model is set up.
"""

from __future__ import annotations

import difflib
import warnings
from dataclasses import dataclass
from typing import Any

from fabric.utilities.exceptions import FabricTypeError, FabricValueError
from fabric.utilities.warnings import PossibleUserWarning


@dataclass(frozen=True)
class ScheduleKind:
    """A torch schedule: its name, whether it runs several stages per process, and how stages go to processes."""

    name: str
    multi: bool
    style: str = "loop"  # "loop": stage s on pipeline rank s % size; "v": down then back up (zero-bubble V)
    stages_per_rank: int | None = None  # fixed by the schedule (ZBV: 2), else stages / pipeline size


SCHEDULES = {
    kind.name.lower(): kind
    for kind in (
        ScheduleKind("GPipe", multi=False),
        ScheduleKind("1F1B", multi=False),
        ScheduleKind("Interleaved1F1B", multi=True),
        ScheduleKind("LoopedBFS", multi=True),
        ScheduleKind("InterleavedZeroBubble", multi=True),
        ScheduleKind("ZBVZeroBubble", multi=True, style="v", stages_per_rank=2),
    )
}


def resolve(name: object, owner: str) -> ScheduleKind:
    """The schedule for a case-insensitive name, or an error that suggests the closest one."""
    if not isinstance(name, str):
        raise FabricTypeError(f"{owner}(schedule={name!r}): expected a schedule name such as '1F1B'.")
    kind = SCHEDULES.get(name.lower())
    if kind is None:
        names = [k.name for k in SCHEDULES.values()]
        close = difflib.get_close_matches(name.lower(), list(SCHEDULES), n=1, cutoff=0.5)
        hint = f" Did you mean {SCHEDULES[close[0]].name!r}?" if close else ""
        raise FabricValueError(
            f"{owner}(schedule={name!r}): unknown pipeline schedule.{hint} Choose one of: {', '.join(names)} "
            "(case does not matter)."
        )
    return kind


def stages_per_rank(kind: ScheduleKind, num_stages: int, pipeline_size: int) -> int | None:
    """How many stages each pipeline process runs, or None when the stages cannot be spread evenly."""
    if not kind.multi:
        return 1 if num_stages == pipeline_size else None
    if num_stages % pipeline_size:
        return None
    per_rank = num_stages // pipeline_size
    if kind.stages_per_rank is not None and per_rank != kind.stages_per_rank:
        return None
    return per_rank


def local_stages(kind: ScheduleKind, num_stages: int, pipeline_size: int, pipeline_rank: int) -> list[int]:
    """The stage indices that run on this pipeline rank, in order."""
    if kind.style == "v":
        owners = [_v_owner(s, pipeline_size) for s in range(num_stages)]
        return [s for s, owner in enumerate(owners) if owner == pipeline_rank]
    return list(range(pipeline_rank, num_stages, pipeline_size))


def local_stages_owner(kind: ScheduleKind, num_stages: int, pipeline_size: int, stage: int) -> int:
    """The pipeline rank that runs `stage`."""
    return _v_owner(stage, pipeline_size) if kind.style == "v" else stage % pipeline_size


def _v_owner(stage: int, pipeline_size: int) -> int:
    # Down the ranks for the first pipeline_size stages, then back up: the last stage sits with the first.
    lap, offset = divmod(stage, pipeline_size)
    return offset if lap % 2 == 0 else pipeline_size - 1 - offset


def schedule_class(kind: ScheduleKind) -> Any:
    """torch's schedule class (imports torch.distributed.pipelining)."""
    from torch.distributed.pipelining.schedules import get_schedule_class

    return get_schedule_class(kind.name)


def check_torch_for_backend(backend: str, version: tuple[int, int, int]) -> None:
    """Refuse or warn where torch's pipelining is known not to run over `backend`.

    Measured here with torch's own PipelineStage and ScheduleGPipe on 2 CPU processes, no fabric involved: over
    gloo, torch 2.9 aborts both processes in the first step (gloo::EnforceNotMet, "Received data size doesn't
    match expected size"; pytorch issue 132644 on gloo's batched send/recv), and torch 2.13 runs every schedule.
    Versions in between were not measured, so they get a warning rather than a refusal.
    """
    if backend != "gloo" or version >= (2, 13, 0):
        return
    found = ".".join(map(str, version))
    if version < (2, 10, 0):
        raise RuntimeError(
            f"PipelineStrategy over the gloo backend with torch {found}: torch {found}'s pipelining aborts every "
            "process in the first step over gloo (gloo::EnforceNotMet: received data size doesn't match). Install "
            "torch 2.13 or later for CPU processes, or run on GPUs (NCCL)."
        )
    warnings.warn(
        f"PipelineStrategy over the gloo backend with torch {found}: fabric's pipeline tests run on torch 2.13; "
        "torch 2.9's pipelining aborts over gloo in the first step. If the processes abort with gloo::EnforceNotMet, "
        "install torch 2.13 or later.",
        PossibleUserWarning,
        stacklevel=3,
    )
