"""fsspec URLs (s3://, gs://, memory://, file://, ...) as checkpoint paths: telling them apart, opening their store.

fsspec and its backends (s3fs, gcsfs, ...) are imported only when a URL is used, so `import fabric` stays cheap.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
# A URL squeezed through pathlib.Path loses one slash ("s3://b/k" -> "s3:/b/k"); catch it instead of writing to a
# local folder named "s3:". Single letters are Windows drives ("C:/...").
_MANGLED = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):/[^/]")
# The package each common scheme needs, for the error when it is missing.
_PACKAGES = {
    "s3": "s3fs",
    "s3a": "s3fs",
    "gs": "gcsfs",
    "gcs": "gcsfs",
    "az": "adlfs",
    "abfs": "adlfs",
    "abfss": "adlfs",
    "adl": "adlfs",
    "hf": "huggingface_hub",
    "http": "aiohttp",
    "https": "aiohttp",
    "sftp": "paramiko",
    "ssh": "paramiko",
}
# Stores whose writes publish a whole object at once (a PUT, or a multipart upload completed at the end).
OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "memory"})


def scheme(path: str | Path) -> str | None:
    """The URL scheme of `path` ('s3', 'memory', ...); None for a local path (file:// counts as local)."""
    if isinstance(path, Path):
        mangled = _MANGLED.match(os.fspath(path))
        if mangled and not Path(mangled.group(1) + ":").exists():
            raise FabricTypeError(
                f"path=Path({os.fspath(path)!r}): a pathlib.Path cannot hold a URL (it dropped a slash of "
                f"'{mangled.group(1)}://'). Pass the URL as a string, such as '{mangled.group(1)}://bucket/file.ckpt'."
            )
        return None
    match = _SCHEME.match(str(path))
    if match is None or match.group(1).lower() == "file":
        return None
    return match.group(1).lower()


def is_url(path: str | Path) -> bool:
    """Whether `path` names a remote (non-local) fsspec location."""
    return scheme(path) is not None


def local(path: str | Path) -> Path:
    """A local path, with a `file://` prefix removed."""
    text = os.fspath(path)
    return Path(text[len("file://") :] if text.lower().startswith("file://") else text)


def local_only(path: str | Path, op: str, what: str) -> Path:
    """`path` as a local Path; a URL gets a clear error instead of a local folder named after its scheme."""
    if is_url(path):
        raise FabricValueError(
            f"{op}({str(path)!r}): {what} cannot be written to or read from a URL yet. Use a local or mounted "
            "directory (and copy it to the store afterwards, e.g. `aws s3 cp --recursive`), or a strategy that "
            "saves one checkpoint file."
        )
    return local(path)


def filesystem(path: str, op: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem serving the URL `path`, and the path inside it."""
    from fsspec.core import url_to_fs

    name = scheme(path) or "file"
    try:
        return url_to_fs(path, **(storage_options or {}))
    except ImportError as err:
        package = _PACKAGES.get(name)
        install = f"pip install {package}" if package else "install the fsspec backend package for it"
        raise ImportError(
            f"{op}({path!r}): '{name}://' URLs need the package {package or 'that implements it'}, which is not "
            f"installed ({err}). Run `{install}`, or use a local path."
        ) from None
    except ValueError as err:
        raise FabricValueError(
            f"{op}({path!r}): fsspec knows no filesystem for '{name}://' ({err}). Check the URL's scheme, or use "
            "a local path."
        ) from None


def check_storage_options(storage_options: Any, path: str | Path, op: str) -> dict[str, Any] | None:
    """storage_options configure a remote store; they mean nothing for a local path."""
    if storage_options is None:
        return None
    if not is_url(path):
        raise FabricTypeError(
            f"{op}({os.fspath(path)!r}, storage_options={storage_options!r}): storage options configure a remote "
            "store (an s3://, gs://, ... URL), and this is a local path. Leave them out, or pass a URL."
        )
    if not isinstance(storage_options, dict):
        raise FabricTypeError(
            f"{op}({os.fspath(path)!r}, storage_options={type(storage_options).__name__}): storage options are a "
            "dict of keyword arguments for the fsspec filesystem, such as {'anon': False}."
        )
    return storage_options
