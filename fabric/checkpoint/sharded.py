"""Checkpoints of sharded models: torch.distributed.checkpoint (DCP) directories or full files; load, consolidate.

torch.distributed.checkpoint is imported inside the functions: it is slow to import, and `import fabric` stays cheap.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from torch.nn import Module
from torch.optim import Optimizer

from fabric.checkpoint import files, remote, safe
from fabric.checkpoint import sharded_state as states
from fabric.checkpoint.state import place_plain, unwrap
from fabric.io import _fsspec
from fabric.io._load import DeviceRecorder, UnsafeCheckpointError, check_weights_only, torch_load
from fabric.utilities._loader_state import refuse_plain_loader
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from fabric.io.checkpoint_io import CheckpointIO

# Makes a DCP load planner, given whether a partial load (strict=False) is allowed.
PlannerFactory = Callable[[bool], Any]
_Target = dict[str, Any] | Module | Optimizer | None


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a DCP checkpoint directory (complete or not: loading it names what is missing)."""
    if _fsspec.is_url(path):
        return remote.is_dcp_url(str(path))
    return files.is_dcp_directory(_fsspec.local(path))


def save_sharded(
    path: str | Path,
    state: dict[str, Any],
    filter: dict[str, Callable[[str, Any], bool]] | None,
    world_size: int,
    global_rank: int,
    barrier: Callable[[], None],
    planner: Any = None,
) -> None:
    """Every rank writes its shards into a staging directory; once all are written, rank 0 swaps it into place.

    `planner` replaces DCP's default save planner (xla_spmd passes torch_xla's, which writes each device's shard).
    """
    if _fsspec.is_url(path):
        _save_sharded_remote(str(path), state, filter, world_size, global_rank, barrier, planner)
        return
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint import save as dcp_save

    path = _fsspec.local(path)
    refuse_file(path)
    converted = states.convert("save", state, filter, full=False)
    staging = files.staging_dir(path)
    _staged_save(
        path, global_rank, barrier,
        lambda: dcp_save(converted, storage_writer=FileSystemWriter(staging), planner=planner, no_dist=world_size == 1),
        files.prepare_staging, files.discard_staging, files.swap_into_place,
    )  # fmt: skip


def refuse_file(path: Path) -> None:
    """A sharded checkpoint is a directory; never replace a file with one."""
    if path.is_file():
        raise FileExistsError(
            f"save({str(path)!r}): a file exists at this path, and a sharded checkpoint is a directory. Choose "
            "another path, or remove the file first."
        )


def _staged_save(
    target: Path | str,
    global_rank: int,
    barrier: Callable[[], None],
    write: Callable[[], Any],
    prepare: Callable[[Any], Any],
    discard: Callable[[Any], None],
    publish: Callable[[Any], None],
) -> None:
    """The staging protocol of every synchronous sharded save, local or remote: rank 0 prepares the staging
    place, all ranks write into it, and rank 0 publishes it only once every rank's write succeeded."""
    if global_rank == 0:
        prepare(target)
    barrier()
    try:
        with _quiet_single_process(), _reported("save", target, "writing"):
            write()
    except BaseException:
        # DCP reports a failure of any rank's write on every rank, so every rank gets here.
        if global_rank == 0:
            discard(target)
        raise
    barrier()
    if global_rank == 0:
        publish(target)
    barrier()


def save_full(
    path: str | Path,
    state: dict[str, Any],
    filter: dict[str, Callable[[str, Any], bool]] | None,
    checkpoint_io: CheckpointIO,
    is_global_zero: bool,
) -> None:
    """Every rank takes part in gathering the whole state onto rank 0, which writes one file."""
    converted = states.convert("save", state, filter, full=True)
    if is_global_zero:
        checkpoint_io.save_checkpoint(converted, path)


def load(
    path: str | Path,
    state: _Target,
    strict: bool,
    weights_only: bool | None = None,
    planner: PlannerFactory | None = None,
) -> dict[str, Any]:
    """Restore `state` in place from a DCP directory or a full file; return the entries `state` did not ask for.

    Unless `weights_only` is False, nothing that could run code is unpickled (see _sharded_safe). `planner` makes
    the DCP load planner that reads into `state` in place, given whether a partial load is allowed (xla_spmd passes
    torch_xla's, which fills each device's shard); by default DCP's own.
    """
    check_weights_only(weights_only, "load")
    if _fsspec.is_url(path):
        return _load_remote(str(path), state, strict, weights_only, planner)
    path = _fsspec.local(path)
    if not path.exists():
        raise files.missing_path_error(path)
    if path.is_dir():
        return _load_sharded(path, state, strict, weights_only, planner)
    return _load_full(path, state, strict, weights_only)


def consolidate(path: str | Path, weights_only: bool | None = None) -> dict[str, Any]:
    """One process, no process group: read a whole DCP directory into a nested dict of regular tensors."""
    check_weights_only(weights_only, "consolidate")
    if _fsspec.is_url(path):
        remote.read_checked_metadata(str(path), "consolidate", weights_only)
        return _read_entries(str(path), keys=None, distributed=False, weights_only=weights_only, op="consolidate")
    path = _fsspec.local(path)
    if not path.exists():
        raise files.missing_path_error(path, "consolidate")
    if path.is_file():
        raise FabricValueError(
            f"consolidate({str(path)!r}): this is a file; only a sharded checkpoint directory needs consolidating. "
            "Load the file with torch.load directly."
        )
    files.read_checked_metadata(path, "consolidate", weights_only)
    return _read_entries(path, keys=None, distributed=False, weights_only=weights_only, op="consolidate")


def _save_sharded_remote(
    url: str,
    state: dict[str, Any],
    filter: dict[str, Callable[[str, Any], bool]] | None,
    world_size: int,
    global_rank: int,
    barrier: Callable[[], None],
    planner: Any = None,
) -> None:
    """As save_sharded, onto a URL: shards go to a staging prefix, which rank 0 publishes (see _sharded_remote)."""
    from torch.distributed.checkpoint import save as dcp_save

    remote.check_save_url(url)  # on every rank, before any waits for rank 0
    converted = states.convert("save", state, filter, full=False)
    _staged_save(
        url, global_rank, barrier,
        lambda: dcp_save(converted, storage_writer=remote.writer(url), planner=planner, no_dist=world_size == 1),
        remote.prepare_staging, remote.discard_staging, remote.publish,
    )  # fmt: skip


def _load_remote(
    url: str, state: _Target, strict: bool, weights_only: bool | None, planner: PlannerFactory | None
) -> dict[str, Any]:
    if remote.is_dcp_url(url):
        return _load_sharded(url, state, strict, weights_only, planner)
    from fabric.io.torch_io import _read_remote

    data, _ = _read_remote(url)
    return _load_full(url, state, strict, weights_only, source=data)


# -- sharded directories ------------------------------------------------------------------------------
class _Layout:
    """What a checkpoint holds, from its metadata: each flat DCP key's top-level key and saved shape."""

    def __init__(self, metadata: Any) -> None:
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        mapping = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        self.top: dict[str, str] = {flat: str(mapping.get(flat, (flat,))[0]) for flat in metadata.state_dict_metadata}
        self.shapes: dict[str, tuple[int, ...] | None] = {
            flat: tuple(meta.size) if isinstance(meta, TensorStorageMetadata) else None
            for flat, meta in metadata.state_dict_metadata.items()
        }

    @property
    def keys(self) -> set[str]:
        return set(self.top.values())

    def under(self, key: str) -> dict[str, tuple[int, ...] | None]:
        """The saved shapes of one top-level entry, named relative to it (as the object's own state dict is)."""
        return {flat[len(key) + 1 :]: self.shapes[flat] for flat, top in self.top.items() if top == key}


def _load_sharded(
    path: Path | str, state: _Target, strict: bool, weights_only: bool | None, planner: PlannerFactory | None = None
) -> dict[str, Any]:
    if isinstance(path, str):
        layout = _Layout(remote.read_checked_metadata(path, "load", weights_only))
    else:
        layout = _Layout(files.read_checked_metadata(path, "load", weights_only))
    if state is None:
        return _read_entries(path, keys=None, distributed=states.distributed(), weights_only=weights_only)
    target = unwrap(state)
    if isinstance(target, Module):
        return _load_raw_module(path, target, layout, strict, weights_only, planner)
    if isinstance(target, Optimizer):
        raise FabricTypeError(
            f"load_raw({str(path)!r}, optimizer): a sharded checkpoint stores optimizer state by parameter name, "
            "so it cannot be loaded without its module. Use fabric.load(path, {'model': model, 'optimizer': "
            "optimizer}) with the keys it was saved under."
        )
    if not isinstance(state, dict):
        raise _state_type_error(state)
    _check_missing(path, state, layout.keys, strict)
    present = {key: value for key, value in state.items() if key in layout.keys}
    targets = states.load_targets("load", present)
    for key, target_sd in targets.items():
        _check_entry(path, key, target_sd, layout, strict, isinstance(unwrap(state[key]), Module))
    if targets:
        _read_into(path, targets, strict, weights_only, planner)
        states.apply_loaded("load", state, targets, strict, full=False)
    rest = layout.keys - set(targets)
    values = _read_entries(path, rest, states.distributed(), weights_only) if rest else {}
    return _restore_plain(state, values, skip=set(targets))


def _load_raw_module(
    path: Path | str, module: Module, layout: _Layout, strict: bool, weights_only: bool | None, planner: Any = None
) -> dict[str, Any]:
    """load_raw: the whole checkpoint is one module's state dict, keyed by its parameter names."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    target = get_model_state_dict(module)
    saved = dict(layout.shapes)
    states.check_keys(str(path), "state dict", set(target), set(saved), strict, is_module=True)
    states.check_shapes(str(path), target, saved)
    _read_into(path, target, strict, weights_only, planner)
    set_model_state_dict(module, target, options=states.load_options(False, strict))
    return {}


def _state_type_error(state: object) -> FabricTypeError:
    return FabricTypeError(
        f"load(state={type(state).__name__}): the state must be a dict such as {{'model': model, 'optimizer': "
        "optimizer}, a module or an optimizer. Wrap your objects in a dict."
    )


def _check_missing(path: Path | str, state: dict[str, Any], saved: set[str], strict: bool) -> None:
    missing = [key for key in state if key not in saved]
    if missing and strict:
        raise KeyError(
            f"load({str(path)!r}, state with keys {sorted(state)}): the checkpoint has no entry for {missing}; it "
            f"holds {sorted(saved)}. Load with strict=False to skip missing entries, or fix the keys."
        )


def _check_entry(
    path: Path | str, key: str, target: dict[str, Any], layout: _Layout, strict: bool, is_module: bool
) -> None:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    expected, _ = flatten_state_dict({key: target})
    expected = {flat[len(key) + 1 :]: value for flat, value in expected.items()}
    saved = layout.under(key)
    where = f"{path}[{key!r}]"
    states.check_keys(where, key, set(expected), set(saved), strict, is_module)
    states.check_shapes(where, expected, saved)


def _read_into(
    path: Path | str, targets: dict[str, Any], strict: bool, weights_only: bool | None, planner: Any = None
) -> None:
    """DCP reads each rank's part of the saved tensors straight into `targets` (resharding as needed)."""
    from torch.distributed.checkpoint import load as dcp_load

    base = planner(not strict) if planner is not None else None
    load_planner = safe.load_planner(strict, str(path), "load", weights_only, base)
    with _quiet_single_process(), _reported("load", path, "reading"):
        dcp_load(targets, storage_reader=safe.reader(str(path), "load", weights_only), planner=load_planner)


def _read_entries(
    path: Path | str, keys: set[str] | None, distributed: bool, weights_only: bool | None, op: str = "load"
) -> dict[str, Any]:
    """Whole entries rebuilt from the metadata (regular tensors, unsharded), for values that are not modules."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    # The private loader is what torch's own dcp_to_torch_save uses: the public load() fills a copy of the
    # top-level dict, so entries rebuilt from the metadata would be lost.
    entries: dict[str, Any] = {}
    planner = safe.entries_planner(keys, str(path), op, weights_only)
    reader = safe.reader(str(path), op, weights_only)
    with _reported(op, path, "reading"):
        _load_state_dict(entries, storage_reader=reader, planner=planner, no_dist=not distributed)
    return entries


def _restore_plain(state: dict[str, Any], values: dict[str, Any], skip: set[str]) -> dict[str, Any]:
    """Objects with load_state_dict load their entry; plain values are replaced; the rest is returned."""
    for key in list(state):
        if key in skip or key not in values:
            continue
        target = unwrap(state[key])
        refuse_plain_loader("load", key, target)
        if callable(getattr(target, "load_state_dict", None)):
            target.load_state_dict(values.pop(key))
        else:
            state[key] = values.pop(key)
    return values


# -- full files -------------------------------------------------------------------------------------
def _load_full(
    path: Path | str,
    state: dict[str, Any] | Module | Optimizer | None,
    strict: bool,
    weights_only: bool | None,
    source: IO[bytes] | None = None,
) -> dict[str, Any]:
    # mmap: each rank maps the file instead of reading a full copy of every tensor into memory. Everything lands on
    # CPU; only plain tensors go back to the device they were saved from (modules and optimizers copy themselves).
    recorder = DeviceRecorder()
    if source is None:
        checkpoint = torch_load(str(path), str(path), "load", recorder, weights_only, mmap=True)
    else:  # a URL's bytes, already read into memory
        checkpoint = torch_load(source, str(path), "load", recorder, weights_only)
    checkpoint = place_plain(checkpoint, state, recorder.restore)
    if state is None:
        return checkpoint
    target = unwrap(state)
    if isinstance(target, Module):
        _load_full_module(path, "state dict", target, checkpoint, strict)
        return {}
    if isinstance(target, Optimizer):
        target.load_state_dict(checkpoint)
        return {}
    if not isinstance(state, dict):
        raise _state_type_error(state)
    _check_missing(path, state, set(checkpoint), strict)
    remainder = dict(checkpoint)
    optimizers: dict[str, dict[str, Any]] = {}
    for key in state:
        obj = unwrap(state[key])
        if key not in remainder:
            continue
        if isinstance(obj, Module):
            _load_full_module(path, key, obj, remainder.pop(key), strict)
        elif isinstance(obj, Optimizer):
            optimizers[key] = remainder.pop(key)
    states.apply_loaded("load", state, optimizers, strict, full=states.distributed())
    return _restore_plain(state, remainder, skip=set(optimizers))


def _load_full_module(path: Path | str, key: str, module: Module, saved: dict[str, Any], strict: bool) -> None:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    expected = get_model_state_dict(module)
    where = f"{path}[{key!r}]"
    states.check_keys(where, key, set(expected), set(saved), strict, is_module=True)
    states.check_shapes(where, expected, {name: states.global_shape(value) for name, value in saved.items()})
    full = states.distributed()  # each rank keeps its own shard of the full tensors
    set_model_state_dict(module, dict(saved), options=states.load_options(full, strict))


@contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns each time it runs without a process group; in one process that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


@contextmanager
def _reported(op: str, path: Path | str, doing: str) -> Iterator[None]:
    """DCP's CheckpointException derives from BaseException (so `except Exception` misses it) and prints whole
    tracebacks; turn it into one RuntimeError that names each failing rank's error."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as err:
        for exc, _ in err.failures.values():
            if isinstance(exc, UnsafeCheckpointError):
                raise exc from None  # already names the path and the way to opt in
        causes = "; ".join(f"rank {rank}: {type(exc).__name__}: {exc}" for rank, (exc, _) in err.failures.items())
        after = "The checkpoint at this path was not changed. " if op == "save" else ""
        raise RuntimeError(
            f"{op}({str(path)!r}): {doing} the sharded checkpoint failed ({causes}). {after}Fix the cause (for "
            "example, remove objects that cannot be pickled from the state) and try again."
        ) from err
