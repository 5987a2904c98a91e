"""Experiment loggers: the Logger interface, a CSV logger and a TensorBoard logger (imported on first use)."""

from typing import TYPE_CHECKING

from fabric import _lazy
from fabric.loggers.csv_logs import CSVLogger
from fabric.loggers.logger import Logger

if TYPE_CHECKING:
    from fabric.loggers.tensorboard import TensorBoardLogger

__getattr__, __dir__ = _lazy.exports(__name__, {"TensorBoardLogger": "fabric.loggers.tensorboard"})

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]
