"""fsspec parses every URL: chained URLs (simplecache::memory://...) save and load through their store, or are
refused with a clear error; nothing named after a URL is created locally; staging happens beside the target in the
target's own folder (never in another bucket)."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric, TorchCheckpointIO
from fabric.checkpoint import remote
from fabric.checkpoint import sharded as sc
from fabric.io import _fsspec
from fabric.loggers import CSVLogger
from fabric.utilities.cloud_io import _is_local_file_protocol, _load

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty directory, so a folder named 'simplecache::memory:' would show."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    return work


@pytest.fixture
def memory() -> Iterator[object]:
    import fsspec

    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/chained"):
        fs.rm("/chained", recursive=True)


def _fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def test_a_chained_url_round_trips_through_its_store(in_tmp: Path, memory: object) -> None:
    url = "simplecache::memory://chained/run/last.ckpt"
    torch.manual_seed(0)
    model, other = nn.Linear(3, 2), nn.Linear(3, 2)
    fabric = _fabric()
    fabric.save(url, {"model": model, "step": 5})
    assert memory.isfile("/chained/run/last.ckpt")  # type: ignore[attr-defined]
    assert fabric.load(url, {"model": other}) == {"step": 5}
    assert torch.equal(other.weight, model.weight)
    raw = nn.Linear(3, 2)
    torch.save(model.state_dict(), in_tmp.parent / "raw.pt")
    memory.put_file(str(in_tmp.parent / "raw.pt"), "/chained/run/raw.pt")  # type: ignore[attr-defined]
    fabric.load_raw("simplecache::memory://chained/run/raw.pt", raw)
    assert torch.equal(raw.weight, model.weight)
    assert torch.equal(_load("simplecache::memory://chained/run/raw.pt")["weight"], model.weight)
    assert list(in_tmp.iterdir()) == []


def test_a_chained_url_onto_a_local_folder_stages_beside_the_target(tmp_path: Path, in_tmp: Path) -> None:
    target = tmp_path / "out" / "last.ckpt"
    url = f"simplecache::file://{target}"
    io_ = TorchCheckpointIO()
    io_.save_checkpoint({"step": 1}, url)
    io_.save_checkpoint({"step": 2}, url)  # the second replaces the first by a rename inside "out"
    assert sorted(p.name for p in target.parent.iterdir()) == ["last.ckpt"]
    assert io_.load_checkpoint(url) == {"step": 2}
    assert not _is_local_file_protocol(url) and _is_local_file_protocol(f"file://{target}")
    assert list(in_tmp.iterdir()) == []


@pytest.mark.parametrize("path", ["x::memory://chained/last.ckpt", "run/a::b.ckpt"])
def test_a_chain_fsspec_would_misread_is_refused(in_tmp: Path, path: str) -> None:
    # fsspec itself opens 'x::memory://...' as a local folder named 'x:', and 'run/a::b.ckpt' as the folder 'run/a'.
    with pytest.raises(ValueError, match=r"is not a protocol fsspec knows.*pass a local file name that contains"):
        _fabric().save(path, {"step": 1})
    with pytest.raises(ValueError, match=r"is not a protocol fsspec knows"):
        CSVLogger(path)
    assert list(in_tmp.iterdir()) == []


def test_a_local_name_with_double_colons_is_saved_as_a_path(in_tmp: Path) -> None:
    _fabric().save(Path("run/a::b.ckpt"), {"step": 1})
    assert (in_tmp / "run" / "a::b.ckpt").is_file()


def test_a_chained_url_in_a_pathlib_path_is_refused(in_tmp: Path) -> None:
    with pytest.raises(TypeError, match=r"a pathlib.Path cannot hold a URL.*'simplecache://bucket/file.ckpt'"):
        _fabric().save(Path("simplecache::memory://chained/last.ckpt"), {"step": 1})
    assert list(in_tmp.iterdir()) == []


def test_a_sharded_save_to_a_chained_url_is_refused_before_writing(in_tmp: Path, memory: object) -> None:
    state = {"model": nn.Linear(2, 2)}
    with pytest.raises(ValueError, match=r"cannot use a chained URL.*such as 'memory://chained/ckpt'"):
        sc.save_sharded("simplecache::memory://chained/ckpt", state, None, 1, 0, lambda: None)
    assert not memory.exists("/chained")  # type: ignore[attr-defined]
    sc.save_sharded("memory://chained/ckpt", state, None, 1, 0, lambda: None)
    with pytest.raises(ValueError, match=r"load\('simplecache::memory://chained/ckpt'\): .*chained URL"):
        _fabric().load("simplecache::memory://chained/ckpt", {"model": nn.Linear(2, 2)})
    assert list(in_tmp.iterdir()) == []


def test_staging_is_a_sibling_in_the_same_folder(memory: object) -> None:
    assert remote.staging_url("memory://chained/run/ckpt") == "memory://chained/run/.ckpt.saving"
    assert remote.staging_url("memory://chained/run/ckpt/") == "memory://chained/run/.ckpt.saving"
    assert remote.staging_url("memory://ckpt") == "memory://.ckpt.saving"  # the memory store's root is a folder


def test_a_bucket_itself_is_refused_instead_of_staging_in_another_bucket(in_tmp: Path, s3_bucket: str) -> None:
    import s3fs

    state = {"model": nn.Linear(2, 2)}
    with pytest.raises(ValueError, match=r"cannot be the top of its store.*'s3://fabric-test/checkpoints/last.ckpt'"):
        sc.save_sharded(s3_bucket, state, None, 1, 0, lambda: None)
    fs = s3fs.S3FileSystem()
    assert fs.ls("") == ["fabric-test"]  # no bucket '.fabric-test.saving' was made
    sc.save_sharded(f"{s3_bucket}/run/ckpt", state, None, 1, 0, lambda: None)
    assert remote.staging_url(f"{s3_bucket}/run/ckpt") == f"{s3_bucket}/run/.ckpt.saving"
    assert fs.ls("fabric-test/run") == ["fabric-test/run/ckpt"]
    assert list(in_tmp.iterdir()) == []


def test_the_csv_logger_writes_through_a_chained_url(in_tmp: Path, memory: object) -> None:
    logger = CSVLogger("simplecache::memory://chained/logs", name="exp")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    text = memory.cat_file("/chained/logs/exp/version_0/metrics.csv").decode()  # type: ignore[attr-defined]
    assert [row["loss"] for row in csv.DictReader(io.StringIO(text))] == ["1.0"]
    assert list(in_tmp.iterdir()) == []


def test_protocols_come_from_fsspec() -> None:
    assert _fsspec.protocols("simplecache::s3://bucket/key") == ["simplecache", "s3"]
    assert _fsspec.scheme("filecache::gs://bucket/key") == "filecache"
    assert _fsspec.scheme("file:///tmp/x") is None and _fsspec.scheme("/tmp/x") is None
    assert _fsspec.scheme("C:/x") is None  # a Windows drive, not a protocol
