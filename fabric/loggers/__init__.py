"""Experiment loggers: the Logger interface, a CSV logger and a TensorBoard logger."""

from fabric.loggers.csv_logs import CSVLogger
from fabric.loggers.logger import Logger
from fabric.loggers.tensorboard import TensorBoardLogger

__all__ = ["CSVLogger", "Logger", "TensorBoardLogger"]
