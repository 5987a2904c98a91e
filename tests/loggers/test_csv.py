"""Tests for the CSV logger: rows, header widening, versions, lazy directories and hyperparameters."""

from __future__ import annotations

import csv
import json
from argparse import Namespace
from pathlib import Path

import pytest
import torch

from fabric.loggers import CSVLogger


def _read(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    with path.open(newline="") as file:
        reader = csv.DictReader(file)
        return list(reader.fieldnames or []), list(reader)


def test_writes_rows_with_step_column(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"loss": torch.tensor(0.5)}, step=0)
    logger.log_metrics({"loss": 0.25}, step=1)
    logger.save()
    header, rows = _read(Path(logger.log_dir) / "metrics.csv")
    assert header == ["loss", "step"]
    assert rows == [{"loss": "0.5", "step": "0"}, {"loss": "0.25", "step": "1"}]


def test_default_step_is_the_rows_buffered_since_the_last_write_as_in_lightning(tmp_path: Path) -> None:
    # Lightning's CSVLogger: `step = len(self.experiment.metrics)`, the rows not written yet (litgpt logs its final
    # validation loss without a step after writing every row, and gets step 0 in Lightning's file).
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=1)
    for value in (1, 2, 3):
        logger.log_metrics({"a": value})
    buffered = CSVLogger(tmp_path / "buffered", flush_logs_every_n_steps=10)
    for value in (1, 2, 3):
        buffered.log_metrics({"a": value})
    buffered.save()
    _, rows = _read(Path(logger.log_dir) / "metrics.csv")
    _, buffered_rows = _read(Path(buffered.log_dir) / "metrics.csv")
    assert [row["step"] for row in rows] == ["0", "0", "0"]
    assert [row["step"] for row in buffered_rows] == ["0", "1", "2"]


def test_new_key_widens_header_without_losing_rows(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.save()
    logger.log_metrics({"loss": 0.5}, step=1)
    logger.save()
    logger.log_metrics({"loss": 0.1, "acc": 0.9}, step=2)
    logger.finalize("success")
    path = Path(logger.log_dir) / "metrics.csv"
    header, rows = _read(path)
    assert header == ["acc", "loss", "step"]
    assert rows == [
        {"acc": "", "loss": "1.0", "step": "0"},
        {"acc": "", "loss": "0.5", "step": "1"},
        {"acc": "0.9", "loss": "0.1", "step": "2"},
    ]
    assert not path.with_name("metrics.csv.tmp").exists()


def test_flushes_every_n_calls(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, flush_logs_every_n_steps=2)
    path = Path(logger.log_dir) / "metrics.csv"
    logger.log_metrics({"a": 1.0}, step=10)
    assert not path.exists()
    logger.log_metrics({"a": 2.0}, step=20)
    assert len(_read(path)[1]) == 2


def test_no_directories_before_first_write(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path / "logs")
    assert logger.log_dir == str(tmp_path / "logs" / "lightning_logs" / "version_0")
    logger.finalize("success")
    assert not (tmp_path / "logs").exists()


def test_version_auto_increments(tmp_path: Path) -> None:
    (tmp_path / "exp" / "version_0").mkdir(parents=True)
    (tmp_path / "exp" / "version_3").mkdir()
    (tmp_path / "exp" / "version_x").mkdir()
    logger = CSVLogger(tmp_path, name="exp")
    assert logger.version == 4
    logger.log_metrics({"a": 1.0})
    logger.save()
    # Once chosen, the version stays even though version_4 now exists.
    assert logger.version == 4
    assert CSVLogger(tmp_path, name="exp").version == 5


def test_explicit_version_and_no_name(tmp_path: Path) -> None:
    assert CSVLogger(tmp_path, name=None, version="run-a").log_dir == str(tmp_path / "run-a")
    assert CSVLogger(tmp_path, version=2).log_dir == str(tmp_path / "lightning_logs" / "version_2")


def test_prefix(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path, prefix="train")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.save()
    header, _ = _read(Path(logger.log_dir) / "metrics.csv")
    assert header == ["step", "train-loss"]


def test_reused_version_warns_and_replaces(tmp_path: Path) -> None:
    first = CSVLogger(tmp_path, version=0)
    first.log_metrics({"old": 1.0}, step=0)
    first.save()
    second = CSVLogger(tmp_path, version=0)
    second.log_metrics({"new": 2.0}, step=0)
    with pytest.warns(UserWarning, match="exists from an earlier run"):
        second.save()
    header, rows = _read(Path(second.log_dir) / "metrics.csv")
    assert header == ["new", "step"]
    assert len(rows) == 1


def test_multi_element_tensor_raises(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    with pytest.raises(ValueError, match=r"log_metrics\('loss'=tensor of shape \(2,\)\): a metric must be"):
        logger.log_metrics({"loss": torch.ones(2)})


def test_bad_flush_interval_raises(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"flush_logs_every_n_steps=0\): .*Pass 1 or more"):
        CSVLogger(tmp_path, flush_logs_every_n_steps=0)


def test_hyperparams_are_merged_into_json(tmp_path: Path) -> None:
    logger = CSVLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1, "layers": [1, 2], "device": torch.device("cpu")})
    logger.log_hyperparams(Namespace(batch_size=8, lr=0.2))
    params = json.loads((Path(logger.log_dir) / "hparams.json").read_text())
    assert params == {"lr": 0.2, "layers": [1, 2], "device": "cpu", "batch_size": 8}


def test_bad_hyperparams_type_raises(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match=r"log_hyperparams\(params=int\): hyperparameters must be a dict"):
        CSVLogger(tmp_path).log_hyperparams(3)
