"""fsspec URLs (s3://, gs://, memory://, simplecache::s3://, ...) as checkpoint paths: telling them apart from local
paths, opening their store, and naming siblings (staging) inside it.

fsspec parses every URL: its protocol (`fsspec.utils.get_protocol`), the chain of a `simplecache::s3://...` URL, and
the file system with the path inside it (`fsspec.core.url_to_fs`). fsspec and its backends (s3fs, gcsfs, ...) are
imported only when a path can be a URL, so `import fabric` and local saves stay cheap.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

# A URL squeezed through pathlib.Path loses one slash ("s3://b/k" -> "s3:/b/k"); catch it instead of writing to a
# local folder named "s3:". Single letters are Windows drives ("C:/...").
_MANGLED = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]+):/[^/]")
_LOCAL = frozenset({"file", "local"})
# The package each common protocol needs, for the error when it is missing.
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


def _may_be_url(text: str) -> bool:
    # fsspec.utils.get_protocol finds a protocol only before '::' or '://': a path with neither is local, and needs
    # no fsspec import (about 85 ms) to say so.
    return "::" in text or "://" in text


def protocols(path: str) -> list[str]:
    """The protocols of a URL's chain, outermost first (['simplecache', 's3'] for 'simplecache::s3://b/k'); raises
    a clear error for a chain fsspec would misread (it opens 'x::memory://k' as a local folder named 'x:')."""
    from fsspec import available_protocols
    from fsspec.utils import get_protocol

    known = set(available_protocols())
    found = []
    bits = path.split("::")
    for index, bit in enumerate(bits):
        protocol = bit if bit in known else get_protocol(bit)
        if protocol not in known or (index < len(bits) - 1 and bit != protocol):
            raise FabricValueError(
                f"{path!r}: {bit!r} is not a protocol fsspec knows, so this is neither a URL nor, with its '::', a "
                f"plain local path. Check the URL (a chain reads like 'simplecache::s3://bucket/file.ckpt'), or pass "
                "a local file name that contains '::' as a pathlib.Path."
            )
        found.append(protocol)
    return found


def scheme(path: str | os.PathLike[str]) -> str | None:
    """The outermost protocol of the URL `path` ('s3', 'simplecache', ...); None for a local path (and file://)."""
    if not isinstance(path, str):
        _refuse_url_in_path(os.fspath(path))
        return None
    if not _may_be_url(path):
        return None
    chain = protocols(path)
    if len(chain) == 1 and chain[0] in _LOCAL:
        return None
    return chain[0]


def _refuse_url_in_path(text: str) -> None:
    """A pathlib.Path holds local paths only: one that reads like a URL lost a slash of it and would become a
    local folder named after the URL."""
    mangled = _MANGLED.match(text)
    if mangled and Path(mangled.group(1) + ":").exists():
        return  # a local folder that really is named like this
    if mangled:
        protocol = mangled.group(1)
    elif "::" in text:
        from fsspec import available_protocols

        protocol = text.split("::", 1)[0]
        if protocol not in set(available_protocols()):
            return  # a local name that contains '::'
    else:
        return
    raise FabricTypeError(
        f"path=Path({text!r}): a pathlib.Path cannot hold a URL (it turns '://' into ':/'). Pass the URL as a "
        f"string, such as '{protocol}://bucket/file.ckpt'."
    )


def is_url(path: str | os.PathLike[str]) -> bool:
    """Whether `path` names a remote (non-local) fsspec location."""
    return scheme(path) is not None


def local(path: str | os.PathLike[str]) -> Path:
    """A local path: a `file://` URL's path, and `~` expanded as Lightning (through fsspec) does."""
    text = os.fspath(path)
    if isinstance(path, str) and _may_be_url(text):
        from fsspec.core import url_to_fs

        return Path(url_to_fs(text)[1])
    return _expanded(text)


def _expanded(text: str) -> Path:
    try:
        return Path(text).expanduser()
    except RuntimeError:
        return Path(text)  # '~name' of no known user is a plain name, as os.path.expanduser leaves it


def expand_user(path: str | Path) -> str | Path:
    """`path` with a leading `~` expanded where it is local; a URL unchanged."""
    if is_url(path) or not os.fspath(path).startswith("~"):
        return path
    expanded = _expanded(os.fspath(path))
    return str(expanded) if isinstance(path, str) else expanded


def local_only(path: str | os.PathLike[str], op: str, what: str) -> Path:
    """`path` as a local Path; a URL gets a clear error instead of a local folder named after its scheme."""
    if is_url(path):
        raise FabricValueError(
            f"{op}({os.fspath(path)!r}): {what} cannot be written to or read from a URL yet. Use a local or mounted "
            "directory (and copy it to the store afterwards, e.g. `aws s3 cp --recursive`), or a strategy that "
            "saves one checkpoint file."
        )
    return local(path)


def filesystem(path: str, op: str, storage_options: dict[str, Any] | None = None) -> tuple[AbstractFileSystem, str]:
    """The fsspec filesystem serving the URL `path`, and the path inside it."""
    from fsspec.core import url_to_fs

    chain = protocols(path)
    try:
        return url_to_fs(path, **(storage_options or {}))
    except ImportError as err:
        name = _missing(chain)
        package = _PACKAGES.get(name)
        install = f"pip install {package}" if package else "install the fsspec backend package for it"
        raise ImportError(
            f"{op}({path!r}): '{name}://' URLs need the package {package or 'that implements it'}, which is not "
            f"installed ({err}). Run `{install}`, or use a local path."
        ) from None
    except ValueError as err:
        raise FabricValueError(
            f"{op}({path!r}): fsspec cannot open this URL ({err}). Check the URL and its protocols "
            f"({', '.join(chain)}), or use a local path."
        ) from None


def _missing(chain: list[str]) -> str:
    """The protocol of the chain whose backend package fails to import."""
    from fsspec.registry import get_filesystem_class

    for name in chain:
        try:
            get_filesystem_class(name)
        except ImportError:
            return name
    return chain[-1]


def target_protocols(fs: AbstractFileSystem) -> tuple[str, ...]:
    """The protocols of the store `fs` finally writes to: caching wrappers (simplecache::, filecache::) and dir::
    hold it as `fs`."""
    from fsspec import AbstractFileSystem

    while isinstance(getattr(fs, "fs", None), AbstractFileSystem):
        fs = fs.fs
    return (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)


def publishes_whole(fs: AbstractFileSystem) -> bool:
    """Whether a write to `fs` appears at once, whole (an object store), rather than growing in place."""
    return any(name in OBJECT_STORES for name in target_protocols(fs))


def sibling(url: str, fs: AbstractFileSystem, inner: str, rename: Callable[[str], str], op: str) -> tuple[str, str]:
    """The URL and inner path of `rename(base name)` beside `url` (the same folder of the same store), from the
    filesystem's own parent and separator: a bucket's sibling would be another bucket, so a bucket is refused."""
    stripped = inner.rstrip(fs.sep) or inner
    parent = fs._parent(stripped)
    base = stripped[len(parent) :].lstrip(fs.sep)
    trimmed = url.rstrip("/")
    if not parent or parent == stripped or not base or not trimmed.endswith(base):
        raise FabricValueError(
            f"{op}({url!r}): a checkpoint cannot be the top of its store (a bucket, or the root): a save writes "
            "beside it first, and there is no 'beside' there. Name a folder inside it, such as "
            f"'{trimmed}/checkpoints/last.ckpt'."
        )
    name = rename(base)
    return trimmed[: -len(base)] + name, parent.rstrip(fs.sep) + fs.sep + name


def check_storage_options(storage_options: Any, path: str | os.PathLike[str], op: str) -> dict[str, Any] | None:
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
