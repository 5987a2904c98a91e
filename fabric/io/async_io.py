"""AsyncCheckpointIO: a save returns once the state is copied; a background thread writes the copy."""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric.io._snapshot import BufferPool
from fabric.io.checkpoint_io import CheckpointIO
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from torch.nn import Module
    from torch.optim import Optimizer
    from torch.utils.hooks import RemovableHandle


class AsyncCheckpointIO(CheckpointIO):
    """Wraps another CheckpointIO (default: TorchCheckpointIO) and runs its saves in a background thread.

    `save_checkpoint` copies the tensors (into pinned CPU memory when they live on a GPU) and returns; the
    wrapped plugin then writes the copy, atomically as before. One save is in flight at a time: the next save,
    a load, `wait()` and `teardown()` first wait for it, and raise its error if it failed.
    """

    asynchronous = True

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        if checkpoint_io is None:
            from fabric.io.torch_io import TorchCheckpointIO

            checkpoint_io = TorchCheckpointIO()
        if not isinstance(checkpoint_io, CheckpointIO):
            raise FabricTypeError(
                f"AsyncCheckpointIO(checkpoint_io={type(checkpoint_io).__name__}): expected a CheckpointIO such as "
                "TorchCheckpointIO(), whose saves it runs in the background. Pass a CheckpointIO instance, or None."
            )
        if checkpoint_io.asynchronous:
            raise FabricValueError(
                f"AsyncCheckpointIO(checkpoint_io={type(checkpoint_io).__name__}()): that plugin already saves in the "
                "background; wrapping it again would copy every checkpoint twice. Pass it to plugins=[...] directly."
            )
        self._checkpoint_io = checkpoint_io
        self._pool = BufferPool()
        self._background = _Background()
        # Step hooks of `reserve_after_first_step`: all of them (removed by teardown), and those that fired but
        # could not remove themselves yet (removed by the next save; see `_remove_after_step`).
        self._step_hooks: list[RemovableHandle] = []
        self._spent_hooks: list[RemovableHandle] = []
        # Reports a failure nobody was told about when this object is collected or the interpreter exits (after
        # Python has joined the writing thread, which is not a daemon). It must not reference `self`.
        self._finalizer = weakref.finalize(self, self._background.close)

    @property
    def checkpoint_io(self) -> CheckpointIO:
        """The plugin that writes and reads the files."""
        return self._checkpoint_io

    def reserve(self, state: Any) -> int:
        """Prepare the memory the next save of `state` copies into, in the background; returns its bytes.

        `state` is what you will pass to `fabric.save` (modules and optimizers count as their state dicts). A
        daemon thread allocates the CPU buffers for its tensors of 1 MiB and more that are not held yet and
        faults their pages in, so the first save only copies. Call it once the state has its final tensors
        (for optimizers: after the first step, which creates Adam's moments). A save waits for a reservation
        still running; buffers the save does not use are freed. Fabric calls it after the first optimizer step.
        """
        return self._pool.reserve(state)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Wait for the previous save, copy `checkpoint`, and write the copy in the background."""
        self._remove_spent_hooks()
        self.wait()
        snapshot = self._pool.snapshot(checkpoint)
        writer = self._checkpoint_io

        def write() -> None:
            writer.save_checkpoint(snapshot, path, storage_options=storage_options)

        self._background.start(str(path), write)

    def submit(self, path: str | Path, job: Callable[[], None]) -> None:
        """Run `job` in the background after the previous save; its error is raised like a failed save's."""
        self.wait()
        self._background.start(str(path), job)

    def load_checkpoint(
        self, path: str | Path, map_location: Any = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Wait for the pending save (it may be this very file), then read through the wrapped plugin."""
        self.wait()
        return self._checkpoint_io.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: str | Path) -> None:
        """Wait for the pending save, then delete through the wrapped plugin."""
        self.wait()
        self._checkpoint_io.remove_checkpoint(path)

    def wait(self) -> None:
        """Block until the save in flight is written; raise its error if it failed (once)."""
        self._background.join()
        failure = self._background.take_failure()
        if failure is not None:
            path, error = failure
            raise RuntimeError(_failure_message(path, error)) from error

    def teardown(self) -> None:
        """Wait for the save in flight (raising its error), free the copy buffers, tear the wrapped plugin down."""
        self._spent_hooks, self._step_hooks = self._step_hooks, []
        self._remove_spent_hooks()
        try:
            self.wait()
        finally:
            self._pool.clear()
            self._checkpoint_io.teardown()

    def reserve_after_first_step(self, module: Module, optimizers: Sequence[Optimizer]) -> None:
        """Reserve the buffers of a save of `module` and `optimizers` once each optimizer has stepped.

        One-shot step post-hooks: the last to fire calls `reserve` (the optimizers' state exists by then), and
        each is removed after its call, so later steps run no hook at all.
        """
        io, target = weakref.ref(self), weakref.ref(module)
        every = [weakref.ref(optimizer) for optimizer in optimizers]
        waiting = {id(optimizer) for optimizer in optimizers}

        def watch(optimizer: Optimizer) -> None:
            def hook(stepped: Optimizer, args: Any, kwargs: Any) -> None:
                owner = io()
                if id(stepped) not in waiting or owner is None:  # fired before: waits for its removal
                    return
                waiting.discard(id(stepped))
                owner._remove_after_step(stepped, handle)
                module, opts = target(), [ref() for ref in every]
                if not waiting and module is not None and None not in opts:
                    owner.reserve({"module": module, "optimizers": opts})

            handle = optimizer.register_step_post_hook(hook)
            self._step_hooks.append(handle)

        for optimizer in optimizers:
            watch(optimizer)

    def _remove_after_step(self, optimizer: Optimizer, handle: RemovableHandle) -> None:
        # Removing a hook while the optimizer iterates its post-hooks raises, unless it is the last one (the
        # iteration is past it then). Otherwise it is removed before the next save.
        hooks = getattr(optimizer, "_optimizer_step_post_hooks", None)
        if hooks is not None and next(reversed(hooks), None) == handle.id:
            handle.remove()
        else:
            self._spent_hooks.append(handle)

    def _remove_spent_hooks(self) -> None:
        for handle in self._spent_hooks:
            handle.remove()
        self._spent_hooks = []

    # Spawned processes receive the strategy pickled: start each with its own (idle) thread state and buffers.
    def __getstate__(self) -> dict[str, Any]:
        return {"checkpoint_io": self._checkpoint_io}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["checkpoint_io"])  # type: ignore[misc]


class _Background:
    """The write in flight and a failure not yet raised. Shared with the writing thread, which must not hold the
    AsyncCheckpointIO: a Fabric garbage-collected mid-write still completes its save and reports its error."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._failure: tuple[str, BaseException] | None = None
        self._owner_alive = True

    def start(self, path: str, job: Callable[[], None]) -> None:
        assert self._thread is None and self._failure is None, "callers wait() before starting a write"
        # Not a daemon: at interpreter exit Python joins it, so a save issued just before exiting completes.
        thread = threading.Thread(target=self._run, args=(path, job), name="fabric-async-save", daemon=False)
        self._thread = thread
        thread.start()

    def _run(self, path: str, job: Callable[[], None]) -> None:
        try:
            job()
        except BaseException as error:
            with self._lock:
                self._failure = (path, error)
                orphaned = not self._owner_alive
            if orphaned:  # nobody is left to raise it to
                self.close()

    def join(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join()
            self._thread = None

    def take_failure(self) -> tuple[str, BaseException] | None:
        with self._lock:
            failure, self._failure = self._failure, None
        return failure

    def close(self) -> None:
        """The owner is gone (collected, or the interpreter exits): print a failure that was never raised."""
        with self._lock:
            self._owner_alive = False
            failure, self._failure = self._failure, None
        if failure is not None:
            print(f"fabric: {_failure_message(*failure)}", file=sys.stderr, flush=True)


def _failure_message(path: str, error: BaseException) -> str:
    if str(error).startswith(f"save({path!r})"):  # the strategy's own message already names the save and the fix
        return f"{error} (This save ran in the background: fabric.save({path!r}) had already returned.)"
    return (
        f"save({path!r}): the background write of this checkpoint failed ({type(error).__name__}: {error}). The "
        "checkpoint that was at this path before is unchanged. Fix the cause and save again."
    )
