"""Atomic local file replacement that leaves no litter: temporary files say who wrote them, so the next save can
remove those of writers that are provably dead (killed mid-save) and never those of a save still running."""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import IO

_SUFFIX = ".fabric-tmp"


def _host() -> str:
    """This machine and pid namespace: containers on one host share its boot id but not their pids."""
    try:
        namespace = str(Path("/proc/self/ns/pid").readlink())
    except OSError:
        namespace = ""
    return hashlib.sha1(f"{socket.gethostname()}|{namespace}".encode()).hexdigest()[:8]


def _boot_id() -> str:
    """Changes on every reboot (Linux); 'x' where unknown, then only the pid tells."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip().replace("-", "")[:12]
    except OSError:
        return "x"


def _start_time(pid: int) -> str:
    """When process `pid` started, in clock ticks since boot (Linux); 'x' where unknown. Tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "x"
    # The command name (field 2) may contain spaces; the fields after its closing parenthesis are fixed.
    return stat.rsplit(")", 1)[1].split()[19]


def _writer_tag(pid: int | None = None) -> str:
    """Who writes a temporary file: host, boot, pid and the process's start time (this process by default)."""
    pid = os.getpid() if pid is None else pid
    return f"{_host()}-{_boot_id()}-{pid}-{_start_time(pid)}"


def temp_prefix(path: Path) -> str:
    return f".{path.name}."


def _is_dead(tag: str) -> bool:
    """Whether the writer named by `tag` has certainly exited (same host, and a reboot or no such process)."""
    parts = tag.split("-")
    if len(parts) != 4 or parts[0] != _host():
        return False  # another machine (a shared file system): nothing here can prove it stopped
    boot, pid_text, started = parts[1], parts[2], parts[3]
    if boot != "x" and boot != _boot_id():
        return True
    if not pid_text.isdigit():
        return False
    pid = int(pid_text)
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, owned by someone else
    return started != "x" and _start_time(pid) not in ("x", started)


def remove_stale(path: Path) -> None:
    """Delete temporary files of earlier saves to `path` whose writers died before finishing."""
    prefix = temp_prefix(path)
    try:
        names = [entry.name for entry in path.parent.iterdir()]
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(_SUFFIX)):
            continue
        tag = name[len(prefix) : -len(_SUFFIX)].rsplit(".", 1)[0]
        if _is_dead(tag):
            with suppress(OSError):
                (path.parent / name).unlink()


def fsync_directory(directory: Path) -> None:
    """Make a rename in `directory` durable: without it a power loss can undo the rename."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return  # platforms (Windows) that cannot open directories
    try:
        with suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _default_file_mode() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_atomically(path: Path, write: Callable[[IO[bytes]], None]) -> None:
    """Call `write` on a temporary file next to `path`, then rename it over `path`: readers see the old file or
    the new one. A failure removes the temporary file; a killed process leaves it for the next save to remove."""
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(path)
    # Same directory as the target, so the final rename never crosses file systems.
    fd, tmp_name = tempfile.mkstemp(prefix=f"{temp_prefix(path)}{_writer_tag()}.", suffix=_SUFFIX, dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp creates the file private (0o600); give it the mode a plain torch.save would have.
        tmp.chmod(_default_file_mode())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
