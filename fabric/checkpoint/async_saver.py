"""Sharded checkpoints saved in the background: torch.distributed.checkpoint's async_save plus the atomic swap.

Each rank copies its shards to CPU memory (DCP's stager) and returns; DCP writes them into the staging directory
in a thread, then the CheckpointIO's background job waits for that write and rank 0 swaps the directory into
place, exactly as a synchronous sharded save does. torch.distributed.checkpoint is imported inside the methods.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from fabric.checkpoint import files
from fabric.checkpoint import sharded_state as states

if TYPE_CHECKING:
    from fabric.io.checkpoint_io import CheckpointIO


class AsyncShardedSaver:
    """What background sharded saves keep between saves: their own process group and the CPU staging buffers."""

    def __init__(self) -> None:
        self._group: Any = None
        self._group_world: Any = None  # the default group `_group` was created in
        self._stager: Any = None

    def save(
        self,
        path: str | Path,
        state: dict[str, Any],
        filter: dict[str, Callable[[str, Any], bool]] | None,
        checkpoint_io: CheckpointIO,
        global_rank: int,
        barrier: Callable[[], None],
        timeout: timedelta,
        pinned: bool,
    ) -> None:
        """Copy this rank's shards and return; `checkpoint_io` runs the write and the swap in the background."""
        from torch.distributed.checkpoint import FileSystemWriter, async_save

        from fabric.checkpoint.sharded import _reported, refuse_file

        path = Path(path)
        # The previous save may still write into the staging directory this one starts by emptying.
        checkpoint_io.wait()
        refuse_file(path)
        converted = states.convert("save", state, filter, full=False)
        if global_rank == 0:
            files.prepare_staging(path)
        barrier()
        group = self._process_group(timeout) if dist.is_initialized() else None
        try:
            with _reported("save", path, "copying"):
                future = async_save(
                    converted,
                    storage_writer=FileSystemWriter(files.staging_dir(path)),
                    process_group=group,
                    no_dist=group is None,
                    async_stager=self._staging(pinned),
                )
        except BaseException:
            if global_rank == 0:
                files.discard_staging(path)
            raise
        assert isinstance(future, Future), "without async staging, async_save returns one Future"
        checkpoint_io.submit(path, lambda: _finish(path, future, global_rank, group))

    def _process_group(self, timeout: timedelta) -> Any:
        """A gloo group for DCP's collectives in the writing thread, apart from the training's collectives.

        Two threads issuing collectives on one group can interleave them differently on each rank and hang.
        Created on the first save, which every rank makes, in the same order.
        """
        if self._group is None or self._group_world is not dist.group.WORLD:
            self._group = dist.new_group(backend="gloo", timeout=timeout)
            self._group_world = dist.group.WORLD
        return self._group

    def _staging(self, pinned: bool) -> Any:
        """One stager for all saves: it keeps its CPU (pinned, with CUDA) copies and refills them next time."""
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        if self._stager is None:
            options = StagingOptions(
                use_pinned_memory=pinned, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=pinned
            )
            self._stager = DefaultStager(options)
        return self._stager

    def close(self) -> None:
        """Free the staging buffers and forget the process group (destroyed with the default group)."""
        if self._stager is not None:
            self._stager.close()
        self._stager = None
        self._group = self._group_world = None


def _finish(path: Path, future: Future, global_rank: int, group: Any) -> None:
    """In the background, on every rank: wait for DCP's write, then rank 0 swaps the directory into place."""
    from fabric.checkpoint.sharded import _reported

    try:
        try:
            # DCP gathers every rank's write result, so a failure on any rank is raised here on all of them.
            with _reported("save", path, "writing"):
                future.result()
        except BaseException:
            if global_rank == 0:
                files.discard_staging(path)
            raise
        if global_rank == 0:
            files.swap_into_place(path)
    finally:
        # Every rank's wait() returns only after the swap: a load right after it reads the new checkpoint.
        if group is not None:
            dist.barrier(group=group)


def wait_on_every_rank(
    checkpoint_io: CheckpointIO,
    global_rank: int,
    world_size: int,
    all_reduce: Callable[..., Any],
    broadcast: Callable[..., Any],
    device: Any,
) -> None:
    """Wait for this rank's background save, then agree on the outcome: one that failed on any rank raises the
    same error on every rank.

    Only rank 0 writes single files and publishes sharded checkpoints; raising on rank 0 alone would leave the
    others in their next collective until it times out. Costs one small all_reduce when every save went well.
    """
    import torch

    error: Exception | None = None
    try:
        checkpoint_io.wait()
    except Exception as err:
        error = err
    if world_size <= 1:
        if error is not None:
            raise error
        return
    # max(world_size - rank) over the ranks that failed names the lowest of them; 0: none failed.
    mark = torch.tensor(world_size - global_rank if error is not None else 0, device=device)
    top = int(all_reduce(mark, reduce_op="max").item())
    if top == 0:
        return
    source = world_size - top
    message = broadcast(str(error) if error is not None else None, src=source)
    raise RuntimeError(f"{message} [The save failed on global rank {source}; every rank raises this error.]") from (
        error
    )
