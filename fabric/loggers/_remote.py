"""Log directories on fsspec URLs (s3://, memory://, ...): the loggers write into a local mirror, which is uploaded
file by file when they save, so CSV appends and TensorBoard's event files work unchanged on object stores."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from fabric.io import _fsspec


class RemoteDirectory:
    """A URL directory and the local folder that mirrors it."""

    def __init__(self, url: str, op: str) -> None:
        self.url = url.rstrip("/")
        self._op = op
        self._mirror: Path | None = None
        _fsspec.filesystem(self.url, op)  # a missing backend package is an error now, not at the first flush

    @property
    def mirror(self) -> Path:
        """The local folder, created on first use (loggers create nothing before their first write) and again after
        `release`."""
        if self._mirror is None:
            self._mirror = Path(tempfile.mkdtemp(prefix="fabric-logs-"))
        return self._mirror

    def join(self, *parts: str) -> str:
        """The URL of `parts` below this directory."""
        return "/".join([self.url, *(part.strip("/") for part in parts if part)])

    def local(self, *parts: str) -> Path:
        """The mirror folder of `parts` below this directory."""
        return self.mirror.joinpath(*(part for part in parts if part))

    def child_names(self, *parts: str) -> list[str]:
        """The names of the directories below `parts` on the store (empty if it does not exist)."""
        fs, inner = _fsspec.filesystem(self.join(*parts), self._op)
        if not fs.isdir(inner):
            return []
        return [entry["name"].rstrip("/").rsplit("/", 1)[-1] for entry in fs.ls(inner, detail=True)]

    def upload(self, *parts: str) -> None:
        """Copy every mirrored file below `parts` to the store; each file is one upload (whole on object stores)."""
        if self._mirror is None:
            return  # nothing written since the mirror was made or released (asking for it would make one)
        root = self.local(*parts)
        if not root.is_dir():
            return
        fs, _ = _fsspec.filesystem(self.url, self._op)
        # Object stores have no folders to make (s3fs would ask for the bucket each time); the memory store does.
        makedirs = "memory" in _fsspec.target_protocols(fs) or not _fsspec.publishes_whole(fs)
        for file in sorted(p for p in root.rglob("*") if p.is_file() and not p.name.endswith(".tmp")):
            relative = file.relative_to(self.mirror).as_posix()
            _, inner = _fsspec.filesystem(self.join(relative), self._op)
            if makedirs:
                fs.makedirs(fs._parent(inner), exist_ok=True)
            fs.put_file(str(file), inner)

    def download(self, *parts: str) -> None:
        """Copy the file `parts` from the store into the mirror (if the store has it), where a write continues it."""
        fs, inner = _fsspec.filesystem(self.join(*parts), self._op)
        if fs.isfile(inner):
            target = self.local(*parts)
            target.parent.mkdir(parents=True, exist_ok=True)
            fs.get_file(inner, str(target))

    def release(self) -> None:
        """Remove the local mirror once everything in it is uploaded: a finished run leaves no copy behind."""
        if self._mirror is not None:
            shutil.rmtree(self._mirror, ignore_errors=True)
            self._mirror = None
