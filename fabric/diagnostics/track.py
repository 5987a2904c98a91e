"""The scope each fabric collective runs in: record it, check it (debug mode), explain its failure."""

from __future__ import annotations

import atexit
import os
import warnings
import weakref
from collections.abc import Callable, MutableMapping
from types import TracebackType
from typing import Any

import torch.distributed as dist

from fabric.diagnostics.callsite import caller_outside_fabric
from fabric.diagnostics.check import CollectiveMismatchError, check_same_collective
from fabric.diagnostics.explain import explain, failure_kind
from fabric.diagnostics.record import Collective, CollectiveRecorder
from fabric.utilities.distributed import add_note, note_timeout
from fabric.utilities.exceptions import FabricValueError

DEBUG_VARIABLE = "FABRIC_DEBUG_COLLECTIVES"
_ON, _OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")
# torch's Flight Recorder (NCCL): ring-buffer entries kept, and a dump of them when the watchdog sees a timeout.
FLIGHT_RECORDER_ENTRIES = "2000"
# From torch 2.11 the recorder keeps 2000 entries by default; up to 2.10 both its size and the process group's gate
# for dumps default to 0, and the gate reads only the old name, TORCH_NCCL_TRACE_BUFFER_SIZE (the headers of the
# 2.9-2.13 wheels). Setting that name on 2.11+ only earns torch's deprecation warning (seen on torch 2.11, H200).
FLIGHT_RECORDER_ON_BY_DEFAULT = (2, 11, 0)
DEFAULT_DUMP_PREFIX = "/tmp/nccl_trace_rank_"

# Set on an error this module explained, so that an enclosing collective (fabric.save around its barriers) keeps it.
_EXPLAINED = "_fabric_collective_explained"
# One recorder per process group, not per Fabric: two Fabric objects on one group must count its collectives
# together, or the sequence numbers of the ranks would not match. Weak keys: a destroyed group takes its recorder.
_RECORDERS: weakref.WeakKeyDictionary[Any, CollectiveRecorder] = weakref.WeakKeyDictionary()
# The default group's recorder, looked up without building a weak reference per collective: (group ref, recorder).
_LAST: list[Any] = [lambda: None, None]

TimeoutWords = Callable[[], tuple[str, str]]


def debug_enabled(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Whether FABRIC_DEBUG_COLLECTIVES asks for the cross-rank check."""
    value = environ.get(DEBUG_VARIABLE, "").strip().lower()
    if value not in _ON + _OFF:
        raise FabricValueError(
            f"{DEBUG_VARIABLE}={environ[DEBUG_VARIABLE]!r}: not a switch. Set it to 1 to compare every collective "
            "across ranks before it runs, or to 0 (or leave it unset) for no check."
        )
    return value in _ON


def prepare_torch_env(
    backend: str, environ: MutableMapping[str, str] = os.environ, torch_release: tuple[int, int, int] | None = None
) -> list[str]:
    """Before the process group starts: switch on torch's own diagnostics where fabric's cannot see; what was set.

    On NCCL, where calls return when they are enqueued and torch's watchdog ends the process before Python could
    explain anything, torch's Flight Recorder records the collectives instead of fabric's recorder and dumps them
    on a timeout (see docs/troubleshooting.md). A variable the user set is kept.

    Debug mode does not add TORCH_DISTRIBUTED_DEBUG=DETAIL: with it, torch 2.13 (CPU build, gloo) crashes with a
    segmentation fault in DistributedDataParallel's constructor (reproduced with raw torch, no fabric involved).
    """
    wanted: dict[str, str] = {}
    if "nccl" in backend.lower():
        if torch_release is None:  # imported here: `import fabric` does not load the version flags otherwise
            from fabric.utilities.imports import _TORCH

            torch_release = _TORCH
        if torch_release < FLIGHT_RECORDER_ON_BY_DEFAULT:  # the user's TORCH_FR_BUFFER_SIZE also opens the gate
            wanted["TORCH_NCCL_TRACE_BUFFER_SIZE"] = environ.get("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
        wanted["TORCH_NCCL_DUMP_ON_TIMEOUT"] = "1"
    added = [name for name in wanted if name not in environ]
    for name in added:
        environ[name] = wanted[name]
    return added


def flight_recorder_dumps(environ: MutableMapping[str, str] = os.environ) -> str:
    """Where torch's Flight Recorder writes its per-rank dumps: `<prefix><rank>`."""
    return (
        environ.get("TORCH_FR_DUMP_TEMP_FILE") or environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE") or DEFAULT_DUMP_PREFIX
    )


def start_recording() -> CollectiveRecorder | None:
    """Start recording the default group's collectives (once per group); None where the group has no store.

    Not on NCCL unless debug mode asks for the cross-rank check: NCCL calls return when enqueued, so a Python-side
    record would show a rank past collectives it has not finished; torch's Flight Recorder (switched on by
    `prepare_torch_env`) records them instead.
    """
    group = dist.group.WORLD
    recorder = _RECORDERS.get(group)
    if recorder is not None:
        return recorder
    debug = debug_enabled()
    if not debug and "nccl" in str(dist.get_backend()).lower():
        return None
    store = _default_store()
    try:
        recorder = CollectiveRecorder(store, dist.get_rank(), dist.get_world_size(), group, debug)
    except Exception:  # no store, or one that refuses writes: train on, with only the plain timeout message
        if debug:
            warnings.warn(
                f"{DEBUG_VARIABLE}=1: the process group has no rendezvous store fabric can write to, so collectives "
                "are not compared across ranks, and timeouts do not name the missing rank.",
                stacklevel=2,
            )
        return None
    _RECORDERS[group] = recorder
    _LAST[:] = [weakref.ref(group), recorder]
    # Registered after the group's own exit hook, so it runs first: peers see "exited" before the connection drops.
    atexit.register(_finish, recorder)
    return recorder


def stop_recording() -> None:
    """Publish that this rank is done with the default group (before it is destroyed)."""
    world = dist.group.WORLD
    recorder = _RECORDERS.pop(world, None) if world is not None else None
    _LAST[:] = [lambda: None, None]
    if recorder is not None:
        _finish(recorder)


def _default_store() -> Any:
    # torch has no public accessor for the default group's store; without it there is no diagnosis, only the
    # plain timeout message.
    getter = getattr(dist.distributed_c10d, "_get_default_store", None)
    try:
        return getter() if getter is not None else None
    except Exception:
        return None


def _recorder(group: Any) -> CollectiveRecorder | None:
    """The default group's live recorder when the collective runs on it (group None or WORLD), else None."""
    world = dist.group.WORLD
    if group is not None and group is not world:
        return None
    ref, recorder = _LAST
    if world is not None and ref() is world and recorder is not None:  # cleared whenever its recorder finishes
        return recorder
    recorder = _RECORDERS.get(world) if world is not None else None
    if recorder is None or recorder.finished:
        return None
    _LAST[:] = [weakref.ref(world), recorder]
    return recorder


def _finish(recorder: CollectiveRecorder) -> None:
    if _LAST[1] is recorder:
        _LAST[:] = [lambda: None, None]
    recorder.finish()


# The hot path, as three plain calls a strategy method makes around its collective (no object per call):
#     seq = 0
#     try: seq = enter("all_reduce", (tensor, op), group); ... the collective ...
#     except RuntimeError as err: failed(err, "all_reduce", seq, words); raise
#     finally: leave(seq)


def enter(op: str, args: tuple[Any, ...] = (), group: Any = None) -> int:
    """Record that this rank enters collective `op`: its sequence number, or 0 where nothing records it.

    `args`: what must match across ranks in debug mode (tensors by dtype and shape, other values by their text).
    The user's line is kept as its frame's code object and offset (made into `file:line` when something reads it).
    Called by fabric's own methods only: the search for the user's frame starts above the caller.
    """
    recorder = _LAST[1]
    if recorder is not None and group is None and not recorder.debug:
        # The common call, on the default group's recorder cached when the group started. A group destroyed without
        # fabric's teardown leaves it stale until the next group's setup: harmless here (strategies issue nothing
        # without a group, and counting into a record nobody reads changes nothing); `failed` checks it.
        frame = caller_outside_fabric(2)  # 1: the strategy's method, fabric's
        return recorder.enter(op, frame.f_code, frame.f_lasti) if frame is not None else recorder.enter(op, None, -1)
    recorder = _recorder(group)
    if recorder is None:
        if group is not None and os.environ.get(DEBUG_VARIABLE) and debug_enabled():
            warnings.warn(
                f"{DEBUG_VARIABLE}: fabric.{op}(group=...) runs on a subgroup; only collectives of the default group "
                "are compared across ranks and named in timeout messages.",
                stacklevel=4,
            )
        return 0
    frame = caller_outside_fabric(2)  # 1: the strategy's method, fabric's
    seq = recorder.enter(op, frame.f_code, frame.f_lasti) if frame is not None else recorder.enter(op, None, -1)
    if recorder.debug:
        try:
            check_same_collective(recorder, recorder.entered(seq, op), args)
        except BaseException as err:
            err._fabric_seq = seq  # type: ignore[attr-defined]  # for `failed`: the caller has no seq yet
            recorder.leave(seq)
            raise
    return seq


def leave(seq: int) -> None:
    """Record that collective `seq` returned or failed (call it in a `finally`)."""
    if seq:
        recorder = _LAST[1]
        if recorder is not None:
            recorder.leave(seq)


def failed(err: RuntimeError, op: str, seq: int, words: TimeoutWords) -> None:
    """Add to `err` a note that explains it: where every rank is (recorded) or how to wait longer (timeouts)."""
    seq = seq or getattr(err, "_fabric_seq", 0)  # raised by `enter` itself (debug mode's cross-rank check)
    recorder = _recorder(None) if seq else None  # checked: the cached one may be stale
    _explain(err, op, recorder.entered(seq, op) if recorder is not None else None, recorder, words)


def backward_counter() -> CollectiveRecorder | None:
    """What counts backward passes (`.backwards += 1` before each), or None where nothing records (no group, NCCL).

    The default group's recorder: a backward that all-reduces is a collective, but recording it as the others are
    (`enter`/`leave`) costs about 1% of a small DDP step, so the hot path only adds 1, and the job-health thread
    finds a running backward and its line in the stacks. In debug mode (`.debug`) a backward that all-reduces is
    entered instead, to be compared across ranks; a backward that does not is counted in every mode.
    """
    return _recorder(None)


def backward_failed(err: RuntimeError, counter: Any, words: TimeoutWords) -> None:
    """`failed` for a backward pass counted by `counter` (see `backward_counter`): the same note on `err`."""
    recorder = counter if counter is not None and counter is _recorder(None) else None
    collective = None
    if recorder is not None:
        frame = caller_outside_fabric(1)
        collective = recorder.backward_entered(*((frame.f_code, frame.f_lasti) if frame else (None, -1)))
    _explain(err, "backward", collective, recorder, words)


def _explain(
    err: RuntimeError, op: str, collective: Collective | None, recorder: CollectiveRecorder | None, words: TimeoutWords
) -> None:
    if getattr(err, _EXPLAINED, False) or isinstance(err, CollectiveMismatchError):
        return  # a nested collective (a barrier in a save) explained it; a mismatch explains itself
    waited, setting = words()
    if recorder is None or collective is None:
        note_timeout(err, op, waited, setting)
        return
    kind = failure_kind(err)
    if kind is not None:
        add_note(err, explain(recorder, collective, kind, waited, setting))
        setattr(err, _EXPLAINED, True)


class collective:
    """`with collective(op, words, args, group):` around one collective: `enter`, `failed` and `leave` in one.

    For the less frequent collectives (setup, backward, save, load); the hot ones call the functions directly.
    The error keeps its type (a user's `except DistBackendError` still matches); the explanation is a note.
    `words` returns the timeout and the call that sets it, for the message; it is called only on a failure.
    """

    __slots__ = ("_args", "_group", "_op", "_seq", "_words")

    def __init__(self, op: str, words: TimeoutWords, args: tuple[Any, ...] = (), group: Any = None) -> None:
        self._op, self._words, self._args, self._group = op, words, args, group

    def __enter__(self) -> None:
        self._seq = 0
        try:
            self._seq = enter(self._op, self._args, self._group)
        except RuntimeError as err:  # __exit__ does not run when __enter__ raises
            failed(err, self._op, 0, self._words)
            raise

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        try:
            if isinstance(err, RuntimeError):
                failed(err, self._op, self._seq, self._words)
        finally:
            leave(self._seq)
