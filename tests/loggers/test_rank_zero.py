"""The built-in loggers on a rank other than 0 do nothing, as Lightning Fabric's (rank_zero_only.rank set by hand)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fabric.loggers import CSVLogger, Logger, TensorBoardLogger
from fabric.loggers.logger import _DummyExperiment, rank_zero_experiment
from fabric.utilities.rank_zero import rank_zero_only


@pytest.fixture
def rank_one() -> Iterator[None]:
    rank_zero_only.rank = 1
    try:
        yield
    finally:
        rank_zero_only.rank = None  # back to detection


def _loggers(root: Path) -> list[Logger]:
    loggers: list[Logger] = [CSVLogger(root, name="csv")]
    if importlib.util.find_spec("tensorboard") is not None:  # an optional dependency
        loggers.append(TensorBoardLogger(root, name="tb"))
    return loggers


@pytest.mark.usefixtures("rank_one")
def test_on_another_rank_every_call_does_nothing(tmp_path: Path) -> None:
    for logger in _loggers(tmp_path):
        assert isinstance(logger.experiment, _DummyExperiment)  # type: ignore[attr-defined]
        assert logger.log_metrics({"loss": 1.0}, step=0) is None
        assert logger.log_hyperparams({"lr": 0.1}) is None
        logger.experiment.anything(1, key=2)  # type: ignore[attr-defined]
        logger.experiment[0].add_image("x")  # type: ignore[attr-defined]
        logger.experiment["key"] = 3  # type: ignore[attr-defined]
        logger.save()
        logger.finalize("success")
        assert logger.version == 0 and logger.log_dir is not None, "version and log_dir are still answered"
    assert list(tmp_path.iterdir()) == [], "nothing was created"


def test_on_rank_zero_the_loggers_write(tmp_path: Path) -> None:
    for logger in _loggers(tmp_path):
        assert not isinstance(logger.experiment, _DummyExperiment)  # type: ignore[attr-defined]
        logger.log_metrics({"loss": 1.0}, step=0)
        logger.finalize("success")
        assert any(Path(str(logger.log_dir)).iterdir())


class _MyLogger(Logger):
    """A user's logger built on Lightning's decorator, imported from Lightning's path."""

    name = "mine"
    version = 0

    @property
    @rank_zero_experiment
    def experiment(self) -> dict[str, Any]:
        return {"real": True}

    def log_metrics(self, metrics: Any, step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_rank_zero_experiment_of_a_users_logger(rank_one: None) -> None:
    assert isinstance(_MyLogger().experiment, _DummyExperiment)
    rank_zero_only.rank = 0
    assert _MyLogger().experiment == {"real": True}
