"""Saves leave no litter: a save killed midway leaves a temporary file that the next save removes, never one of a
save still running; the previous checkpoint always loads; errors name the user's path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fabric import TorchCheckpointIO
from fabric.io import _atomic

_SAVE_FOREVER = (
    "import sys, torch\n"
    "from fabric import TorchCheckpointIO\n"
    "io, big = TorchCheckpointIO(), {'weights': torch.ones(16 * 1024 * 1024 // 4), 'step': 0}\n"
    "while True:\n"
    "    io.save_checkpoint(big, sys.argv[1])\n"
)


# Temporaries are judged only where this process can tell its boot and pid namespace (Linux, with the namespace's
# own /proc); elsewhere every temporary is kept.
needs_judging = pytest.mark.skipif(
    _atomic._identity() == "x", reason="this system cannot tell its boot and pid namespace, so no temporary is judged"
)


def _temporaries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.name.endswith(".fabric-tmp"))


def _kill_during_a_save(path: Path) -> None:
    # A fresh interpreter, not a fork of pytest: forking a process with live threads (moto's server, torch's pools)
    # can leave the child deadlocked on a lock some thread held at the fork.
    child = subprocess.Popen([sys.executable, "-c", _SAVE_FOREVER, str(path)])
    deadline = time.monotonic() + 120
    try:
        # Kill only once this child's own save is under way: its temporary file (named with its pid) exists.
        while not any(f"-{child.pid}-" in name for name in _temporaries(path.parent)):
            assert child.poll() is None, f"the saving child exited with {child.returncode} before saving"
            assert time.monotonic() < deadline, "the saving child never started a save"
            time.sleep(0.002)
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()


@needs_judging
def test_saves_killed_midway_leave_nothing_after_the_next_save(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    io = TorchCheckpointIO()
    io.save_checkpoint({"step": -1}, path)
    for _ in range(4):
        _kill_during_a_save(path)
        assert _temporaries(tmp_path), "the kill interrupted a save, which left its temporary file"
        loaded = io.load_checkpoint(path)  # the previous checkpoint is always whole
        assert loaded["step"] in (-1, 0)
    io.save_checkpoint({"step": 1}, path)
    assert _temporaries(tmp_path) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    assert io.load_checkpoint(path) == {"step": 1}


@needs_judging
def test_a_live_writers_temporary_file_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = tmp_path / f".last.ckpt.{_atomic._writer_tag(sleeper.pid)}.abcd1234{_atomic._SUFFIX}"
        live.write_bytes(b"a save in progress")
        foreign = tmp_path / f".last.ckpt.0000beef-x-1-x.abcd1234{_atomic._SUFFIX}"  # another machine's save
        foreign.write_bytes(b"a save on another host")
        # The same pid with another start time: a dead writer whose pid the sleeper reused.
        reused = (
            tmp_path / f".last.ckpt.{_atomic._writer_tag(sleeper.pid).rsplit('-', 1)[0]}-1.abcd1234{_atomic._SUFFIX}"
        )
        reused.write_bytes(b"")
        TorchCheckpointIO().save_checkpoint({"step": 1}, path)
        assert live.exists() and foreign.exists()
        assert not reused.exists()
    finally:
        sleeper.kill()
        sleeper.wait()
    TorchCheckpointIO().save_checkpoint({"step": 2}, path)
    assert not live.exists()  # its writer is dead now
    assert foreign.exists()  # nothing here can prove that writer stopped


def test_a_save_to_an_unwritable_place_names_the_users_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    path = blocker / "last.ckpt"
    with pytest.raises(OSError, match=r"save\('.*/file/last.ckpt'\): the checkpoint could not be written") as info:
        TorchCheckpointIO().save_checkpoint({"w": torch.ones(2)}, path)
    assert ".fabric-tmp" not in str(info.value)


def test_the_directory_is_synced_after_the_rename(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import stat

    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        # The rename must already be visible when the directory is synced.
        synced.append(f"{kind}:{(tmp_path / 'last.ckpt').exists()}")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    TorchCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "last.ckpt")
    assert synced == ["file:False", "dir:True"]


def _dead_pid() -> int:
    return 2**22 + 1  # above the kernel's largest pid_max: no process has it


@needs_judging
def test_a_temporary_of_another_machine_or_boot_is_kept_even_with_our_host_name(tmp_path: Path) -> None:
    import hashlib
    import socket

    path = tmp_path / "last.ckpt"
    # Containers are often named alike, and every host's initial pid namespace has the same inode: a host name and
    # namespace that match ours prove nothing. Neither does a boot id other than ours (another machine, or before
    # a reboot): no pid probe here can say whether that writer still runs.
    namespace = str(Path("/proc/self/ns/pid").readlink()) if Path("/proc/self/ns/pid").exists() else ""
    old_host = hashlib.sha1(f"{socket.gethostname()}|{namespace}".encode()).hexdigest()[:8]
    names = [
        f".last.ckpt.{old_host}-{'0' * 12}-{_dead_pid()}-x.abcd1234{_atomic._SUFFIX}",  # the earlier name format
        f".last.ckpt.{'0' * 12}-{_dead_pid()}-1.abcd1234{_atomic._SUFFIX}",  # another boot or pid namespace
        f".last.ckpt.x-{_dead_pid()}-1.abcd1234{_atomic._SUFFIX}",  # a writer that could not tell its namespace
    ]
    for name in names:
        (tmp_path / name).write_bytes(b"a save elsewhere")
    TorchCheckpointIO().save_checkpoint({"step": 1}, path)
    assert _temporaries(tmp_path) == sorted(names)
    dead_here = tmp_path / f".last.ckpt.{_atomic._identity()}-{_dead_pid()}-1.abcd1234{_atomic._SUFFIX}"
    dead_here.write_bytes(b"")
    TorchCheckpointIO().save_checkpoint({"step": 2}, path)
    assert not dead_here.exists()  # the same boot and pid namespace, and no such pid: provably gone


def _unshare(*args: str) -> list[str]:
    import shutil

    if shutil.which("unshare") is None or subprocess.run(["unshare", *args, "true"], check=False).returncode:
        pytest.skip("unshare cannot start a process in its own pid namespace here (it needs root)")
    return ["unshare", *args]


_SAVE_UNTIL_RELEASED = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from fabric.io import _atomic\n"
    "def write(handle):\n"
    "    handle.write(b'from the other namespace')\n"
    "    while not Path(sys.argv[2]).exists():\n"
    "        time.sleep(0.01)\n"
    "_atomic.write_atomically(Path(sys.argv[1]), write)\n"
)


def test_a_live_writer_in_another_pid_namespace_keeps_its_temporary(tmp_path: Path) -> None:
    path, release = tmp_path / "last.ckpt", tmp_path / "release"
    command = [*_unshare("--pid", "--fork", "--mount-proc"), sys.executable, "-c", _SAVE_UNTIL_RELEASED]
    child = subprocess.Popen([*command, str(path), str(release)])
    try:
        deadline = time.monotonic() + 120
        while not _temporaries(tmp_path):
            assert child.poll() is None and time.monotonic() < deadline, "the child never started its save"
            time.sleep(0.01)
        # Its pid (small, in its own namespace) is not running here, or is another process here: neither proves
        # the writer gone, since it is not this namespace's pid.
        TorchCheckpointIO().save_checkpoint({"step": 1}, path)
        assert len(_temporaries(tmp_path)) == 1
    finally:
        release.touch()
        assert child.wait(timeout=120) == 0
    assert path.read_bytes() == b"from the other namespace" and _temporaries(tmp_path) == []


def test_a_pid_namespace_without_its_own_proc_judges_nothing() -> None:
    # `unshare --pid` without a new /proc shows the outer namespace's processes: pids read there are not ours.
    command = [
        *_unshare("--pid", "--fork"),
        sys.executable,
        "-c",
        "from fabric.io import _atomic; print(_atomic._identity())",
    ]
    assert subprocess.run(command, capture_output=True, text=True, check=True).stdout.strip() == "x"
