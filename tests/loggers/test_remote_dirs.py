"""Logger directories on fsspec URLs: memory:// and s3:// (a loopback moto server). Files land exactly there,
never in a local folder named after the scheme."""

from __future__ import annotations

import csv
import io
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from fabric.loggers import CSVLogger, TensorBoardLogger


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def memory_root() -> Iterator[str]:
    import fsspec

    yield "memory://fabric-logs"
    fs = fsspec.filesystem("memory")
    if fs.exists("/fabric-logs"):
        fs.rm("/fabric-logs", recursive=True)


def _rows(fs: object, path: str) -> list[dict[str, str]]:
    return list(csv.DictReader(io.StringIO(fs.cat_file(path).decode())))  # type: ignore[attr-defined]


def _check_csv(root: str, fs: object, inner_root: str) -> None:
    logger = CSVLogger(root, name="exp", flush_logs_every_n_steps=2)
    assert logger.log_dir == f"{root}/exp/version_0"
    logger.log_hyperparams({"lr": 0.1})
    for step in range(3):
        logger.log_metrics({"loss": 1.0 / (step + 1)}, step=step)
    logger.finalize("success")
    rows = _rows(fs, f"{inner_root}/exp/version_0/metrics.csv")
    assert [row["step"] for row in rows] == ["0", "1", "2"]
    hparams = json.loads(fs.cat_file(f"{inner_root}/exp/version_0/hparams.json"))  # type: ignore[attr-defined]
    assert hparams == {"lr": 0.1}
    # The next run finds version_0 on the store and takes version_1.
    assert CSVLogger(root, name="exp").version == 1


def test_csv_logger_on_memory_url(in_tmp: Path, memory_root: str) -> None:
    import fsspec

    _check_csv(memory_root, fsspec.filesystem("memory"), "/fabric-logs")
    assert list(in_tmp.iterdir()) == []


def test_csv_logger_on_s3(in_tmp: Path, s3_bucket: str) -> None:
    import s3fs

    fs = s3fs.S3FileSystem(client_kwargs={"endpoint_url": os.environ["AWS_ENDPOINT_URL"]})
    _check_csv(f"{s3_bucket}/logs", fs, "fabric-test/logs")
    assert list(in_tmp.iterdir()) == []


def test_tensorboard_logger_on_memory_url(in_tmp: Path, memory_root: str) -> None:
    pytest.importorskip("tensorboard")
    import fsspec
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(memory_root, name="tb", sub_dir="train")
    assert logger.log_dir == f"{memory_root}/tb/version_0/train"
    for step in range(3):
        logger.log_metrics({"loss": float(step)}, step=step)
    logger.finalize("success")
    fs = fsspec.filesystem("memory")
    files = fs.ls("/fabric-logs/tb/version_0/train", detail=False)
    assert len(files) == 1 and "events.out.tfevents" in files[0]
    copy = in_tmp / "copy" / "events.out.tfevents.1"
    copy.parent.mkdir()
    copy.write_bytes(fs.cat_file(files[0]))
    events = EventAccumulator(str(copy.parent))
    events.Reload()
    assert [event.value for event in events.Scalars("loss")] == [0.0, 1.0, 2.0]
    assert sorted(p.name for p in in_tmp.iterdir()) == ["copy"]


def test_a_url_whose_package_is_missing_is_named(in_tmp: Path) -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed")
    with pytest.raises(ImportError, match=r"'gs://' URLs need the package gcsfs"):
        CSVLogger("gs://bucket/logs")
    assert list(in_tmp.iterdir()) == []


def test_a_file_url_root_dir_is_a_local_directory(tmp_path: Path) -> None:
    logger = CSVLogger(f"file://{tmp_path}", name="exp")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.save()
    assert (tmp_path / "exp" / "version_0" / "metrics.csv").is_file()


@pytest.fixture
def mirrors(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where the loggers' local mirrors (temporary folders) are made."""
    import tempfile

    folder = tmp_path_factory.mktemp("mirrors")
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def test_csv_logger_removes_its_local_mirror_after_finalize(in_tmp: Path, memory_root: str, mirrors: Path) -> None:
    import fsspec

    logger = CSVLogger(memory_root, name="exp")
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"loss": 1.0}, step=0)
    assert len(list(mirrors.iterdir())) == 1
    logger.finalize("success")
    assert list(mirrors.iterdir()) == []
    logger.save()  # nothing new: no mirror is made again
    assert list(mirrors.iterdir()) == []
    # Logging after finalize continues the file on the store, as it continues a local one.
    logger.log_metrics({"loss": 0.5}, step=1)
    logger.finalize("success")
    rows = _rows(fsspec.filesystem("memory"), "/fabric-logs/exp/version_0/metrics.csv")
    assert [(row["step"], row["loss"]) for row in rows] == [("0", "1.0"), ("1", "0.5")]
    assert list(mirrors.iterdir()) == []
    assert list(in_tmp.iterdir()) == []


def test_tensorboard_logger_removes_its_local_mirror_after_finalize(
    in_tmp: Path, memory_root: str, mirrors: Path
) -> None:
    pytest.importorskip("tensorboard")
    logger = TensorBoardLogger(memory_root, name="tb")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert list(mirrors.iterdir()) == []
    assert list(in_tmp.iterdir()) == []
