"""A logger that writes metrics to a CSV file and hyperparameters to JSON, with no extra dependency."""

from __future__ import annotations

import csv
import json
import warnings
from argparse import Namespace
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TextIO

from torch import Tensor

from fabric.loggers.logger import (
    _add_prefix,
    _params_to_dict,
    _scalar,
    _version_dir_name,
    _VersionedLogger,
    rank_zero_experiment,
)
from fabric.utilities.exceptions import FabricValueError
from fabric.utilities.rank_zero import rank_zero_only


class CSVLogger(_VersionedLogger):
    """Log metrics to ``root_dir/name/version_N/metrics.csv`` and hyperparameters to ``hparams.json``.

    Hyperparameters go to JSON rather than Lightning's ``hparams.yaml`` so that no YAML package is needed;
    every YAML 1.2 parser reads the file as well.

    Args:
        root_dir: the directory experiments are saved under; an fsspec URL (``s3://bucket/logs``) works too:
            the files are written to a local mirror and uploaded each time they are flushed.
        name: the experiment name; ``None`` or ``""`` puts versions directly under ``root_dir``.
        version: the experiment version. ``None`` picks the next free ``version_N``; a string is used as
            the directory name.
        prefix: joined to every metric name as ``prefix-name``.
        flush_logs_every_n_steps: how many ``log_metrics`` calls to buffer before writing to disk.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        root_dir: str | Path,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        prefix: str = "",
        flush_logs_every_n_steps: int = 100,
    ) -> None:
        if flush_logs_every_n_steps < 1:
            raise FabricValueError(
                f"CSVLogger(flush_logs_every_n_steps={flush_logs_every_n_steps}): the logger needs to flush"
                " after at least one call. Pass 1 or more."
            )
        super().__init__(root_dir, name, version)
        self._prefix = prefix
        self._flush_every = flush_logs_every_n_steps
        self._hparams: dict[str, Any] = {}
        self._writer: _MetricsWriter | None = None

    @property
    def log_dir(self) -> str:
        """The directory of this experiment version."""
        return self._version_dir

    @property
    @rank_zero_experiment
    def experiment(self) -> _CSVExperiment:
        """Lightning's experiment writer interface over this logger (``log_metrics``, ``log_hparams``, ``save``);
        on other ranks than 0 a dummy whose methods do nothing."""
        return _CSVExperiment(self)

    @property
    def _local_metrics_path(self) -> Path:
        return Path(self._local_version_dir) / "metrics.csv"

    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float | Tensor], step: int | None = None) -> None:
        """Buffer one row of metrics; it is written every ``flush_logs_every_n_steps`` calls."""
        # A local file's path is fixed once the writer exists (building it took half of this call's 17 us); only a
        # URL's local mirror can move.
        if self._writer is None:
            self._writer = _MetricsWriter(self._local_metrics_path)
        elif self._remote is not None:
            path = self._local_metrics_path
            if self._writer.path != path:
                # finalize removed the local mirror of a URL root_dir: continue the file already on the store.
                self._remote.download(self._name, _version_dir_name(self.version), "metrics.csv")
                self._writer.path = path
        row = {
            key: _scalar(key, value, "CSVLogger")
            for key, value in _add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items()
        }
        # Without a step, Lightning records the number of rows buffered since the last write (so it restarts at 0
        # after each write); clients compare their CSV files with Lightning's, so do the same.
        row["step"] = self._writer.pending if step is None else step
        self._writer.add(row)
        # Counting calls, not step values, so that logging every k-th step still flushes regularly.
        if self._writer.pending >= self._flush_every:
            self.save()

    @rank_zero_only
    def log_hyperparams(self, params: dict[str, Any] | Namespace | Any, *args: Any, **kwargs: Any) -> None:
        """Merge ``params`` into ``hparams.json``; values JSON cannot hold are written as strings."""
        self._hparams.update(_params_to_dict(params, "CSVLogger"))
        path = Path(self._local_version_dir) / "hparams.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self._hparams, indent=2, default=_json_default)
        _atomic_write(path, lambda file: file.write(text + "\n"))
        self._upload()

    @rank_zero_only
    def save(self) -> None:
        """Write buffered metric rows to ``metrics.csv`` (and upload it, for a URL ``root_dir``)."""
        if self._writer is not None:
            self._writer.flush()
            self._upload()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Write anything still buffered; for a URL ``root_dir``, upload it and remove the local mirror."""
        self.save()
        self._release_mirror()


class _CSVExperiment:
    """What Lightning's CSVLogger.experiment offers, writing through the logger (same files, same buffering)."""

    def __init__(self, logger: CSVLogger) -> None:
        self._logger = logger

    @property
    def log_dir(self) -> str:
        """The directory of the experiment version."""
        return self._logger.log_dir

    @property
    def metrics_file_path(self) -> str:
        """The metrics file of the experiment version."""
        return str(Path(self._logger.log_dir, "metrics.csv"))

    def log_metrics(self, metrics_dict: Mapping[str, float | Tensor], step: int | None = None) -> None:
        """Record one row of metrics (see CSVLogger.log_metrics)."""
        self._logger.log_metrics(metrics_dict, step)

    def log_hparams(self, params: dict[str, Any]) -> None:
        """Record hyperparameters (see CSVLogger.log_hyperparams)."""
        self._logger.log_hyperparams(params)

    def save(self) -> None:
        """Write buffered rows."""
        self._logger.save()


def _json_default(value: Any) -> Any:
    if isinstance(value, Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def _atomic_write(path: Path, write: Callable[[TextIO], object]) -> None:
    # Write next to the target and swap it in, so a crash mid-write leaves the previous file whole.
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", newline="") as file:
        write(file)
    tmp.replace(path)


class _MetricsWriter:
    """Buffers metric rows and writes them to one CSV file, widening the header when new keys appear."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._rows: list[dict[str, Any]] = []
        self._keys: list[str] = []
        self._started = False

    @property
    def pending(self) -> int:
        return len(self._rows)

    def add(self, row: dict[str, Any]) -> None:
        self._rows.append(row)

    def flush(self) -> None:
        if not self._rows:
            return
        new_keys = set().union(*self._rows) - set(self._keys)
        # Sorted like Lightning's CSVLogger so files from both look the same.
        keys = sorted(set(self._keys) | new_keys)
        if not self._started:
            self._warn_if_replacing()
            self._write_all(keys, self._rows)
        elif new_keys:
            # CSV cannot add a column in place: rewrite the old rows under the wider header.
            self._write_all(keys, self._read_rows() + self._rows)
        else:
            self._append(self._rows)
        self._keys = keys
        self._rows = []
        self._started = True

    def _warn_if_replacing(self) -> None:
        if self.path.exists():
            warnings.warn(
                f"CSVLogger: {self.path} exists from an earlier run with the same version; it is replaced"
                " now. Pass version=None to write each run to a fresh version directory.",
                UserWarning,
                stacklevel=4,
            )

    def _read_rows(self) -> list[dict[str, Any]]:
        with self.path.open(newline="") as file:
            return list(csv.DictReader(file))

    def _write_all(self, keys: list[str], rows: list[dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)

        def write(file: TextIO) -> None:
            writer = csv.DictWriter(file, fieldnames=keys, restval="")
            writer.writeheader()
            writer.writerows(rows)

        _atomic_write(self.path, write)

    def _append(self, rows: list[dict[str, Any]]) -> None:
        # Appending never touches rows already on disk, so it needs no temporary file.
        with self.path.open("a", newline="") as file:
            csv.DictWriter(file, fieldnames=self._keys, restval="").writerows(rows)
