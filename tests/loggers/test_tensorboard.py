"""Tests for the TensorBoard logger: event files, lazy import, versions and the missing-package error."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fabric.loggers import TensorBoardLogger
from fabric.loggers import tensorboard as tb_module


def _events(log_dir: str) -> EventAccumulator:
    accumulator = EventAccumulator(log_dir)
    accumulator.Reload()
    return accumulator


def test_writes_scalars_to_event_file(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"loss": torch.tensor(0.5), "acc": 0.75}, step=3)
    logger.finalize("success")
    files = list(Path(logger.log_dir).glob("events.out.tfevents.*"))
    assert files, "no event file was written"
    scalars = _events(logger.log_dir).Scalars("loss")
    assert [(event.step, event.value) for event in scalars] == [(3, 0.5)]


def test_dict_values_become_scalar_groups(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    logger.log_metrics({"loss": {"train": 1.0, "val": 2.0}}, step=0)
    logger.finalize("success")
    # add_scalars writes each member to its own sub-directory.
    assert {p.name for p in Path(logger.log_dir).iterdir() if p.is_dir()} == {"loss_train", "loss_val"}


def test_prefix_and_sub_dir(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, name="exp", version="v", prefix="train", sub_dir="sub")
    assert logger.log_dir == str(tmp_path / "exp" / "v" / "sub")
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert "train-loss" in _events(logger.log_dir).Tags()["scalars"]


def test_hyperparams_write_hparams_and_hp_metric(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"lr": 0.1, "opt": {"name": "sgd"}, "device": torch.device("cpu")})
    logger.finalize("success")
    accumulator = _events(logger.log_dir)
    assert [event.value for event in accumulator.Scalars("hp_metric")] == [-1.0]
    plugin_data = accumulator.summary_metadata["_hparams_/session_start_info"].plugin_data.content
    assert b"opt/name" in plugin_data and b"sgd" in plugin_data


def test_no_default_hp_metric(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path, default_hp_metric=False)
    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"loss": 1.0}, step=0)
    logger.finalize("success")
    assert "hp_metric" not in _events(logger.log_dir).Tags()["scalars"]


# add_graph traces with torch.jit, which newer torch marks deprecated; that is tensorboard's concern.
@pytest.mark.filterwarnings("ignore:`torch.jit.trace:DeprecationWarning")
def test_log_graph(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    model = torch.nn.Linear(2, 1)
    logger.log_graph(model, torch.ones(1, 2))
    logger.finalize("success")
    assert _events(logger.log_dir).Graph() is not None


def test_log_graph_without_input_warns(tmp_path: Path) -> None:
    logger = TensorBoardLogger(tmp_path)
    with pytest.warns(UserWarning, match="no example input was found"):
        logger.log_graph(torch.nn.Linear(2, 1))


def test_no_directories_before_first_write_and_version_increments(tmp_path: Path) -> None:
    (tmp_path / "lightning_logs" / "version_1").mkdir(parents=True)
    logger = TensorBoardLogger(tmp_path)
    logger.finalize("success")
    assert not Path(logger.log_dir).exists()
    assert logger.version == 2


def test_missing_tensorboard_raises(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(tb_module, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"TensorBoardLogger needs the `tensorboard` package") as info:
        TensorBoardLogger(tmp_path)
    assert "pip install torchfabric[tensorboard]" in str(info.value)
    assert isinstance(info.value, ImportError)


def test_import_does_not_import_tensorboard() -> None:
    code = "import sys, fabric.loggers; print('tensorboard' in sys.modules, 'torch.utils.tensorboard' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    assert result.stdout.strip() == "False False"
