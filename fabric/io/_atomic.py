"""Atomic local file replacement that leaves no litter: temporary files say who wrote them, so the next save can
remove those whose writer provably exited (killed mid-save), and never one of a save that may still be running.

Proof comes only from this kernel: a temporary is judged only when its writer ran in this boot and this pid
namespace (the same pids); then a pid that no longer exists, or that now belongs to a process started at another
time, proves its writer gone. A writer on another machine, in another container's pid namespace, before a reboot,
or where /proc cannot tell, is never judged: its temporary stays (the name says who wrote it).
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import uuid
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import IO

_SUFFIX = ".fabric-tmp"
# One file name holds at most 255 bytes on the common file systems (ext4, xfs, btrfs, APFS; NTFS counts 255 UTF-16
# units, never fewer than the UTF-8 bytes).
_NAME_MAX = 255
# What a temporary name adds after its prefix: the writer's tag (identity 12, pid 7, start time 20, two dashes),
# mkstemp's '.' and 8 random characters, and the suffix; 32 hex digits of a uuid fit in the same room.
_AFTER_PREFIX = 48 + 1 + 8 + len(_SUFFIX)


def _identity() -> str:
    """This machine's boot and pid namespace, the room in which a pid names one process; 'x' where unknown."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = str(Path("/proc/self/ns/pid").readlink())
        # /proc must be this pid namespace's own (`unshare --pid` without a new /proc shows the outer one's pids),
        # since pids are probed and start times read through it.
        if str(Path("/proc/self").readlink()) != str(os.getpid()):
            return "x"
    except OSError:
        return "x"
    return hashlib.sha1(f"{socket.gethostname()}|{boot}|{namespace}".encode()).hexdigest()[:12]


def _start_time(pid: int) -> str:
    """When process `pid` started, in clock ticks since boot (Linux); 'x' where unknown. Tells a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return "x"
    # The command name (field 2) may contain spaces; the fields after its closing parenthesis are fixed.
    return stat.rsplit(")", 1)[1].split()[19]


def _writer_tag(pid: int | None = None) -> str:
    """Who writes a temporary file: boot and pid namespace, pid and the process's start time (this process by
    default)."""
    pid = os.getpid() if pid is None else pid
    return f"{_identity()}-{pid}-{_start_time(pid)}"


def fitting(stem: str, reserve: int) -> str:
    """`stem`, or its start and a hash of all of it, so that `reserve` more bytes still fit in one file name."""
    room = _NAME_MAX - reserve
    if len(os.fsencode(stem)) <= room:
        return stem
    digest = "~" + hashlib.sha1(os.fsencode(stem)).hexdigest()[:10]
    kept = stem[: room - len(digest)]  # a character is at least one byte
    while len(os.fsencode(kept + digest)) > room:
        kept = kept[:-1]
    return kept + digest


def temp_prefix(path: Path | str) -> str:
    """The start of the temporary names of saves to `path` (a Path, or the base name of a remote one)."""
    name = path.name if isinstance(path, Path) else path
    return f".{fitting(name, 2 + _AFTER_PREFIX)}."


def remote_temp_name(name: str) -> str:
    """A unique temporary name beside the remote file `name`, short enough for the store's name limit."""
    return f"{temp_prefix(name)}{uuid.uuid4().hex}{_SUFFIX}"


def _is_dead(tag: str) -> bool:
    """Whether the writer named by `tag` has certainly exited: it ran in this boot and pid namespace, and its pid
    is gone or belongs to a process that started at another time."""
    parts = tag.split("-")
    if len(parts) != 3 or parts[0] == "x" or parts[0] != _identity() or not parts[1].isdigit():
        return False  # another machine, container or boot, or an older name: nothing here can prove it stopped
    pid, started = int(parts[1]), parts[2]
    if pid == os.getpid():
        return False  # this process: another thread may be saving to the same path
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # a process of another user has this pid now: its start time tells whether it is the writer
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
