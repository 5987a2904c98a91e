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
