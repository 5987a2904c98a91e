"""Paths as Lightning takes them: a file name of 200 to 250 characters saves (the temporary name beside it still fits
the 255-byte limit of one name), locally and remotely; '~' is the home directory, never a folder named '~'."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric, TorchCheckpointIO
from fabric.io import _atomic
from fabric.loggers import CSVLogger, TensorBoardLogger

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _name(length: int) -> str:
    return "n" * (length - len(".ckpt")) + ".ckpt"


@pytest.fixture
def memory() -> Iterator[object]:
    import fsspec

    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/long"):
        fs.rm("/long", recursive=True)


@pytest.mark.parametrize("length", [200, 250])
def test_a_long_file_name_saves_locally(tmp_path: Path, length: int) -> None:
    path = tmp_path / _name(length)
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.save(path, {"step": 1})
    fabric.save(path, {"step": 2})  # replacing it goes through a temporary file beside it
    assert fabric.load(path) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.mark.parametrize("length", [200, 250])
def test_a_long_file_name_saves_remotely(tmp_path: Path, memory: object, length: int) -> None:
    io = TorchCheckpointIO()
    for url in (f"memory://long/{_name(length)}", f"simplecache::file://{tmp_path}/{_name(length)}"):
        io.save_checkpoint({"step": 1}, url)
        io.save_checkpoint({"step": 2}, url)  # the file:// store replaces it by a rename from a temporary name
        assert io.load_checkpoint(url) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == [_name(length)]


@pytest.mark.parametrize("length", [200, 250])
def test_a_long_file_name_saves_to_s3(s3_bucket: str, length: int) -> None:
    url = f"{s3_bucket}/run/{_name(length)}"
    TorchCheckpointIO().save_checkpoint({"step": 1}, url)
    assert TorchCheckpointIO().load_checkpoint(url) == {"step": 1}


@pytest.mark.parametrize("name", [_name(200), _name(250), "é" * 127, "x" * 255])
def test_temporary_names_fit_one_name_and_stay_distinct(name: str) -> None:
    # The longest writer tag: Linux's largest pid (pid_max 2**22) and a start time of 20 digits.
    longest_tag = f"{'f' * 12}-{2**22}-{'9' * 20}"
    temporary = f"{_atomic.temp_prefix(Path(name))}{longest_tag}.abcdefgh{_atomic._SUFFIX}"
    assert len(os.fsencode(temporary)) <= 255
    assert len(os.fsencode(_atomic.remote_temp_name(name))) <= 255
    # Shortened prefixes keep a hash of the whole name: names that differ only at their end do not share one.
    assert _atomic.temp_prefix(Path(name)) != _atomic.temp_prefix(Path(name[:-1] + "Z"))


@pytest.mark.skipif(_atomic._identity() == "x", reason="this system cannot tell its boot and pid namespace")
def test_a_killed_save_of_a_long_name_is_cleaned_up(tmp_path: Path) -> None:
    path = tmp_path / _name(250)
    dead = f"{_atomic.temp_prefix(path)}{_atomic._identity()}-{2**22 + 1}-1.abcdefgh{_atomic._SUFFIX}"
    (tmp_path / dead).write_bytes(b"")  # a pid above the kernel's pid_max: no process has it
    TorchCheckpointIO().save_checkpoint({"step": 1}, path)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HOME is a fresh folder, and the working directory another, where a folder named '~' would show."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return home


def test_save_and_load_expand_the_home_directory(home: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    model = nn.Linear(2, 2)
    fabric.save("~/x.ckpt", {"model": model, "step": 3})
    assert (home / "x.ckpt").is_file()
    fresh = nn.Linear(2, 2)
    assert fabric.load("~/x.ckpt", {"model": fresh}) == {"step": 3}
    assert torch.equal(fresh.weight, model.weight)
    torch.save(model.state_dict(), home / "raw.pt")
    raw = nn.Linear(2, 2)
    fabric.load_raw(Path("~/raw.pt"), raw)
    assert torch.equal(raw.weight, model.weight)
    TorchCheckpointIO().save_checkpoint({"step": 4}, Path("~/io.ckpt"))
    assert TorchCheckpointIO().load_checkpoint("~/io.ckpt") == {"step": 4}
    assert sorted(p.name for p in home.iterdir()) == ["io.ckpt", "raw.pt", "x.ckpt"]
    assert list(Path.cwd().iterdir()) == []


def test_loggers_expand_the_home_directory(home: Path) -> None:
    logger = CSVLogger("~/logs", name="exp")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert logger.root_dir == str(home / "logs")
    assert (home / "logs" / "exp" / "version_0" / "metrics.csv").is_file()
    pytest.importorskip("tensorboard")
    tensorboard = TensorBoardLogger("~/tb", name="exp")
    tensorboard.log_metrics({"loss": 1.0}, step=0)
    tensorboard.finalize("success")
    assert any((home / "tb" / "exp" / "version_0").iterdir())
    assert list(Path.cwd().iterdir()) == []
