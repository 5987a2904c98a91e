"""Sharded (DCP) checkpoint directories on fsspec URLs: written by torch's FsspecWriter, read by its FsspecReader.

Object stores have no rename, so a save writes every shard to a hidden staging prefix first; only when all ranks
have written does rank 0 publish it: the previous `.metadata` goes first (the old checkpoint stops being loadable),
the new shards are copied, and the new `.metadata` goes last (the new one becomes loadable). A crash while
publishing leaves the complete new checkpoint at the staging prefix, and loading the path says so.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fabric.checkpoint import files
from fabric.checkpoint.safe import load_metadata
from fabric.io import _atomic, _fsspec
from fabric.io._load import UnsafeCheckpointError
from fabric.utilities.exceptions import FabricValueError


def _staged_name(base: str) -> str:
    return f".{_atomic.fitting(base, len('..saving'))}.saving"


def _staging(url: str, op: str) -> tuple[str, Any, str]:
    """The staging prefix beside `url`, named through the store's own parent and separator: its URL, the file
    system and the path inside it."""
    refuse_chained(url, op)
    fs, inner = _fsspec.filesystem(url, op)
    staged_url, staged = _fsspec.sibling(url, fs, inner, _staged_name, op)
    return staged_url, fs, staged


def staging_url(url: str) -> str:
    return _staging(url, "save")[0]


def check_save_url(url: str) -> None:
    """Every rank, before any of them waits for rank 0: a URL the save cannot stage beside is refused on each."""
    _staging(url, "save")


def refuse_chained(url: str, op: str) -> None:
    """torch's FsspecWriter and FsspecReader open every shard by its URL string, which a chained URL's store does
    not understand (its rename fails midway): refuse before anything is written."""
    chain = _fsspec.protocols(url)
    if len(chain) > 1:
        raise FabricValueError(
            f"{op}({url!r}): a sharded checkpoint is written and read by torch.distributed.checkpoint, which cannot "
            f"use a chained URL ('{chain[0]}::...'). Pass the store's own URL, such as {url.rsplit('::', 1)[-1]!r}; "
            "single-file checkpoints work with chained URLs."
        )


def is_dcp_url(url: str) -> bool:
    """Whether the URL is a DCP checkpoint directory (it holds `.metadata` or shard files)."""
    fs, inner = _fsspec.filesystem(url, "load")
    if not fs.isdir(inner):
        return False
    names = _names(fs, inner)
    found = files.METADATA_FILE in names or any(name.endswith(".distcp") for name in names)
    if found:
        refuse_chained(url, "load")
    return found


def _names(fs: Any, inner: str) -> list[str]:
    return [entry.rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(inner, detail=False)]


def missing_error(url: str, op: str) -> FileNotFoundError:
    message = f"{op}({url!r}): no checkpoint exists at this URL. Check it, or save one first."
    staged_url, fs, staged = _staging(url, op)
    if fs.exists(f"{staged}/{files.METADATA_FILE}"):
        message += (
            f" A save was interrupted while publishing it; the complete new checkpoint is at "
            f"{staged_url!r}: copy it to {url!r} to load it."
        )
    return FileNotFoundError(message)


def read_checked_metadata(url: str, op: str, weights_only: bool | None) -> Any:
    """Read `.metadata` through the safe unpickler and check that every shard it refers to is there."""
    fs, inner = _fsspec.filesystem(url, op)
    if not fs.exists(inner):
        raise missing_error(url, op)
    metadata_path = f"{inner}/{files.METADATA_FILE}"
    if not fs.exists(metadata_path):
        shards = [name for name in _names(fs, inner) if name.endswith(".distcp")]
        if not shards:
            raise FabricValueError(
                f"{op}({url!r}): this is not a torch.distributed.checkpoint (sharded) checkpoint: it has no "
                f"{files.METADATA_FILE} and no .distcp files. Pass a directory written by a sharded save."
            )
        message = (
            f"{op}({url!r}): the checkpoint is incomplete: {files.METADATA_FILE} is missing. The save that wrote it "
            "did not finish; load an earlier checkpoint."
        )
        staged_url, _, staged = _staging(url, op)
        if fs.exists(f"{staged}/{files.METADATA_FILE}"):
            message += f" The complete new checkpoint is at {staged_url!r}: copy it to {url!r} to load it."
        raise RuntimeError(message)
    try:
        with fs.open(metadata_path, "rb") as handle:
            metadata = load_metadata(handle, url, op, weights_only)
    except UnsafeCheckpointError:
        raise
    except Exception as err:
        raise RuntimeError(
            f"{op}({url!r}): the checkpoint's {files.METADATA_FILE} cannot be read ({type(err).__name__}: {err}); "
            "it is truncated or corrupt. Load an earlier checkpoint."
        ) from None
    files.check_storage(url, metadata, op, _remote_size(fs, inner))
    return metadata


def _remote_size(fs: Any, inner: str) -> Callable[[str], int | None]:
    def size_of(name: str) -> int | None:
        try:
            return int(fs.info(f"{inner}/{name}")["size"])
        except FileNotFoundError:
            return None

    return size_of


def prepare_staging(url: str) -> None:
    """Rank 0: remove what an interrupted save left at the staging prefix."""
    _, fs, staged = _staging(url, "save")
    if fs.exists(staged):
        fs.rm(staged, recursive=True)


def discard_staging(url: str) -> None:
    prepare_staging(url)


def publish(url: str) -> None:
    """Rank 0: replace the checkpoint at `url` by the staged one; `.metadata` last, so a reader never sees a mix."""
    fs, inner = _fsspec.filesystem(url, "save")
    _, _, staged = _staging(url, "save")
    if fs.exists(inner):
        old_metadata = f"{inner}/{files.METADATA_FILE}"
        if fs.exists(old_metadata):
            fs.rm(old_metadata)
        fs.rm(inner, recursive=True)
    names = sorted(_names(fs, staged), key=lambda name: name == files.METADATA_FILE)
    for name in names:
        fs.copy(f"{staged}/{name}", f"{inner}/{name}")
    fs.rm(staged, recursive=True)


def writer(url: str) -> Any:
    """torch's fsspec storage writer for the staging prefix of `url`."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(staging_url(url))
