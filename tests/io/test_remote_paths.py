"""fsspec URLs as checkpoint paths: memory:// and s3:// (a local moto S3 server on 127.0.0.1), written exactly
there and never to a local folder named after the scheme; saves publish atomically."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric, TorchCheckpointIO


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run in an empty directory, so a folder named 's3:' or 'memory:' would show."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def memory_url() -> Iterator[str]:
    import fsspec

    fs = fsspec.filesystem("memory")
    yield "memory://fabric-test/run"
    if fs.exists("/fabric-test"):
        fs.rm("/fabric-test", recursive=True)


def _fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def _round_trip(url: str) -> None:
    fabric = _fabric()
    torch.manual_seed(0)
    model, other = nn.Linear(3, 2), nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters())
    fabric.save(f"{url}/last.ckpt", {"model": model, "optimizer": optimizer, "step": 5})
    remainder = fabric.load(f"{url}/last.ckpt", {"model": other})
    assert torch.equal(other.weight, model.weight)
    assert remainder["step"] == 5
    fabric.load_raw(f"{url}/last.ckpt", nn.Linear(3, 2), strict=False)  # keys differ; the read itself works


def _unpicklable() -> Any:
    return lambda: None  # a lambda cannot be pickled: torch.save fails partway through the state


def _failed_overwrite_keeps_previous(url: str) -> None:
    io = TorchCheckpointIO()
    io.save_checkpoint({"step": 1}, url)
    with pytest.raises(Exception, match=r"pickle|lambda"):
        io.save_checkpoint({"step": 2, "weights": torch.ones(1000), "bad": _unpicklable()}, url)
    assert io.load_checkpoint(url) == {"step": 1}
    io.save_checkpoint({"step": 3}, url)
    assert io.load_checkpoint(url) == {"step": 3}


def test_memory_urls_round_trip_and_stay_off_the_local_disk(in_tmp: Path, memory_url: str) -> None:
    import fsspec

    _round_trip(memory_url)
    assert fsspec.filesystem("memory").exists("/fabric-test/run/last.ckpt")
    _failed_overwrite_keeps_previous(f"{memory_url}/atomic.ckpt")
    assert list(in_tmp.iterdir()) == []


def test_file_urls_are_local_paths(in_tmp: Path) -> None:
    url = f"file://{in_tmp}/sub/last.ckpt"
    TorchCheckpointIO().save_checkpoint({"step": 1}, url)
    assert (in_tmp / "sub" / "last.ckpt").is_file()
    assert _fabric().load(url) == {"step": 1}


def test_a_url_without_its_filesystem_package_names_the_package(in_tmp: Path) -> None:
    pytest.importorskip("fsspec")
    if _installed("gcsfs"):
        pytest.skip("gcsfs is installed, so gs:// URLs work")
    with pytest.raises(ImportError, match=r"save\('gs://bucket/last.ckpt'\): 'gs://' URLs need the package gcsfs"):
        _fabric().save("gs://bucket/last.ckpt", {"step": 1})
    with pytest.raises(ImportError, match=r"pip install gcsfs"):
        _fabric().load("gs://bucket/last.ckpt")
    assert list(in_tmp.iterdir()) == []


def test_a_url_in_a_pathlib_path_is_refused(in_tmp: Path) -> None:
    with pytest.raises(TypeError, match=r"a pathlib.Path cannot hold a URL.*Pass the URL as a string"):
        _fabric().save(Path("s3://bucket/last.ckpt"), {"step": 1})
    assert list(in_tmp.iterdir()) == []


def test_deepspeed_directories_refuse_urls_clearly(in_tmp: Path) -> None:
    from fabric.strategies.deepspeed import checkpoint as _deepspeed_checkpoint

    with pytest.raises(ValueError, match=r"DeepSpeed checkpoints cannot be written to or read from a URL yet"):
        _deepspeed_checkpoint.consolidate_deepspeed("memory://x/ckpt")
    assert list(in_tmp.iterdir()) == []


def _installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def test_s3_round_trip_and_atomic_overwrite(in_tmp: Path, s3_bucket: str) -> None:
    import s3fs

    _round_trip(f"{s3_bucket}/run")
    _failed_overwrite_keeps_previous(f"{s3_bucket}/run/atomic.ckpt")
    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
    assert sorted(fs.ls("fabric-test/run")) == ["fabric-test/run/atomic.ckpt", "fabric-test/run/last.ckpt"]
    assert list(in_tmp.iterdir()) == []
