"""Tests for TorchCheckpointIO: round trips, atomic replacement, and the errors users can hit."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from fabric import TorchCheckpointIO
from fabric.io import torch_io


def _names(directory: Path) -> list[str]:
    return sorted(entry.name for entry in directory.iterdir())


def _checkpoint() -> dict[str, Any]:
    return {"weights": torch.arange(6.0).reshape(2, 3), "step": 7, "name": "run", "nested": {"ids": [1, 2]}}


def test_save_load_round_trip(tmp_path: Path) -> None:
    io = TorchCheckpointIO()
    path = tmp_path / "model.ckpt"
    io.save_checkpoint(_checkpoint(), path)
    loaded = io.load_checkpoint(path)
    assert torch.equal(loaded["weights"], torch.arange(6.0).reshape(2, 3))
    assert loaded["weights"].device == torch.device("cpu")
    assert {k: v for k, v in loaded.items() if k != "weights"} == {"step": 7, "name": "run", "nested": {"ids": [1, 2]}}
    assert _names(tmp_path) == ["model.ckpt"]


def test_save_accepts_a_string_path_and_creates_parent_directories(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "last.ckpt"
    TorchCheckpointIO().save_checkpoint({"x": 1}, str(path))
    assert TorchCheckpointIO().load_checkpoint(str(path)) == {"x": 1}


def test_save_replaces_an_existing_checkpoint(tmp_path: Path) -> None:
    io = TorchCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1}, path)
    io.save_checkpoint({"step": 2}, path)
    assert io.load_checkpoint(path) == {"step": 2}
    assert _names(tmp_path) == ["last.ckpt"]


def test_failed_save_leaves_the_previous_checkpoint_intact(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = TorchCheckpointIO()
    path = tmp_path / "last.ckpt"
    io.save_checkpoint({"step": 1, "weights": torch.ones(3)}, path)
    before = path.read_bytes()

    def failing_save(obj: Any, handle: Any, *args: Any, **kwargs: Any) -> None:
        handle.write(b"half a checkpoint")  # the disk filled up, or the process was interrupted
        raise OSError("No space left on device")

    monkeypatch.setattr(torch_io.torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left on device"):
        io.save_checkpoint({"step": 2, "weights": torch.zeros(3)}, path)
    monkeypatch.undo()

    assert path.read_bytes() == before
    assert _names(tmp_path) == ["last.ckpt"]  # no temporary file left behind
    loaded = io.load_checkpoint(path)
    assert loaded["step"] == 1
    assert torch.equal(loaded["weights"], torch.ones(3))


def test_interrupted_save_leaves_no_file_when_there_was_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def interrupted_save(obj: Any, handle: Any, *args: Any, **kwargs: Any) -> None:
        handle.write(b"partial")
        raise KeyboardInterrupt

    monkeypatch.setattr(torch_io.torch, "save", interrupted_save)
    with pytest.raises(KeyboardInterrupt):
        TorchCheckpointIO().save_checkpoint({"step": 1}, tmp_path / "new.ckpt")
    assert _names(tmp_path) == []


def test_save_onto_a_directory_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "keep.txt").write_text("user data")
    with pytest.raises(IsADirectoryError, match=r"the path is a directory, and a single-file checkpoint cannot"):
        TorchCheckpointIO().save_checkpoint({"x": 1}, target)
    assert (target / "keep.txt").read_text() == "user data"
    assert _names(tmp_path) == ["ckpt"]


def test_load_missing_path(tmp_path: Path) -> None:
    path = tmp_path / "nope.ckpt"
    with pytest.raises(FileNotFoundError, match=r"load\(.*nope.ckpt'\): no checkpoint exists at this path"):
        TorchCheckpointIO().load_checkpoint(path)


def test_load_a_directory(tmp_path: Path) -> None:
    with pytest.raises(IsADirectoryError, match=r"this is a directory, not a single-file checkpoint"):
        TorchCheckpointIO().load_checkpoint(tmp_path)


def test_storage_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(
        TypeError, match=r"storage_options=\{'compress': True\}\): storage options configure a remote store"
    ):
        TorchCheckpointIO().save_checkpoint({"x": 1}, tmp_path / "a.ckpt", storage_options={"compress": True})
    assert _names(tmp_path) == []


def test_load_with_map_location(tmp_path: Path) -> None:
    path = tmp_path / "a.ckpt"
    TorchCheckpointIO().save_checkpoint({"t": torch.ones(2)}, path)
    loaded = TorchCheckpointIO().load_checkpoint(path, map_location=torch.device("cpu"))
    assert loaded["t"].device.type == "cpu"


def test_remove_checkpoint_file_and_directory(tmp_path: Path) -> None:
    io = TorchCheckpointIO()
    file_path = tmp_path / "a.ckpt"
    io.save_checkpoint({"x": 1}, file_path)
    io.remove_checkpoint(file_path)
    assert not file_path.exists()

    directory = tmp_path / "sharded"
    (directory / "inner").mkdir(parents=True)
    (directory / "inner" / "shard0.pt").write_bytes(b"0")
    io.remove_checkpoint(str(directory))
    assert not directory.exists()

    io.remove_checkpoint(tmp_path / "never-existed.ckpt")  # nothing to remove is not an error
    assert _names(tmp_path) == []


def test_saved_file_gets_the_usual_permissions(tmp_path: Path) -> None:
    umask = os.umask(0)
    os.umask(umask)
    path = tmp_path / "a.ckpt"
    TorchCheckpointIO().save_checkpoint({"x": 1}, path)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
