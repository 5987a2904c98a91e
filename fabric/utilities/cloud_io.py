"""Files on local disks and remote stores (s3://, gs://, http(s)://, ...) through fsspec, Lightning's ``cloud_io``."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from fabric.utilities.types import _MAP_LOCATION_TYPE, _PATH

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem


def get_filesystem(path: _PATH, **kwargs: Any) -> AbstractFileSystem:
    """The fsspec file system that serves ``path`` (local for plain paths); ``kwargs`` go to its constructor."""
    try:
        from fsspec.core import url_to_fs
    except ImportError:
        raise ModuleNotFoundError(
            f"get_filesystem({str(path)!r}): the fsspec package is not installed, so no file system can be "
            "chosen for this path. Install it: pip install fsspec (plus s3fs, gcsfs, ... for remote stores)."
        ) from None
    fs, _ = url_to_fs(str(path), **kwargs)
    return fs


def _load(path_or_url: IO | _PATH, map_location: _MAP_LOCATION_TYPE = None, weights_only: bool | None = None) -> Any:
    """``torch.load`` from an open file, a local path, an http(s) URL or any fsspec URL (chained ones too)."""
    if not isinstance(path_or_url, (str, Path)):  # an open file object
        return torch.load(path_or_url, map_location=map_location, weights_only=weights_only)  # type: ignore[arg-type]
    text = str(path_or_url)
    if _protocol(text) in ("http", "https"):
        return torch.hub.load_state_dict_from_url(
            text,
            map_location=map_location,  # type: ignore[arg-type]
            # torch.hub's own default is False; None means the safe default here, as in every other branch.
            weights_only=weights_only is not False,
        )
    if "://" not in text and _is_local_file_protocol(text):
        # '~/model.pt' is the home directory's, as fsspec (and so Lightning) reads it.
        with contextlib.suppress(RuntimeError):  # '~name' of no known user stays as it is
            text = str(Path(text).expanduser())
        return torch.load(text, map_location=map_location, weights_only=weights_only)  # type: ignore[arg-type]
    from fsspec.core import url_to_fs

    fs, inner = url_to_fs(text)
    with fs.open(inner, "rb") as handle:
        return torch.load(handle, map_location=map_location, weights_only=weights_only)  # type: ignore[arg-type]


def _protocol(text: str) -> str:
    # fsspec.utils.get_protocol finds a protocol only before '::' or '://': without either, the path is local and
    # fsspec need not be imported.
    if "::" not in text and "://" not in text:
        return "file"
    from fsspec.utils import get_protocol

    return get_protocol(text)


def _is_local_file_protocol(path: _PATH) -> bool:
    """Whether fsspec reads ``path`` as a local file (a plain path or ``file://``; not ``simplecache::file://``)."""
    return _protocol(str(path)) in ("file", "local")


__all__ = ["get_filesystem"]


_OBJECT_STORES = ("s3", "s3a", "gs", "gcs", "abfs", "az", "adl")


def _is_dir(fs: AbstractFileSystem, path: _PATH, strict: bool = False) -> bool:
    """Whether ``path`` can serve as a directory on ``fs``.

    Object stores (s3, gcs, azure) have no real directories: unless ``strict``, any path there that is not an
    existing file counts as one (it is created on the first write). Elsewhere this is ``fs.isdir(path)``.
    """
    protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
    if any(p in _OBJECT_STORES for p in protocols):
        return bool(fs.isdir(path)) if strict else not bool(fs.isfile(path))
    return bool(fs.isdir(path))
