"""A logger that writes TensorBoard event files; tensorboard is imported only when it first writes."""

from __future__ import annotations

import os
import warnings
from argparse import Namespace
from collections.abc import Mapping
from importlib.util import find_spec
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor
from torch.nn import Module

from fabric.loggers.logger import (
    _add_prefix,
    _params_to_dict,
    _scalar,
    _VersionedLogger,
    rank_zero_experiment,
)
from fabric.utilities.rank_zero import rank_zero_only

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter


class TensorBoardLogger(_VersionedLogger):
    """Log to ``root_dir/name/version_N[/sub_dir]`` in TensorBoard's format.

    Args:
        root_dir: the directory experiments are saved under; an fsspec URL (``s3://bucket/logs``) works too:
            the event files are written to a local mirror and uploaded on ``save()`` and ``finalize()``.
        name: the experiment name; ``None`` or ``""`` puts versions directly under ``root_dir``.
        version: the experiment version. ``None`` picks the next free ``version_N``; a string is used as
            the directory name.
        default_hp_metric: whether ``log_hyperparams`` without metrics logs a placeholder ``hp_metric``
            of -1, so TensorBoard's HPARAMS tab shows the run.
        prefix: joined to every metric name as ``prefix-name``.
        sub_dir: a directory inside the version directory to write to.
        **kwargs: passed on to ``torch.utils.tensorboard.SummaryWriter``.
    """

    LOGGER_JOIN_CHAR = "-"

    def __init__(
        self,
        root_dir: str | Path,
        name: str | None = "lightning_logs",
        version: int | str | None = None,
        default_hp_metric: bool = True,
        prefix: str = "",
        sub_dir: str | Path | None = None,
        **kwargs: Any,
    ) -> None:
        # find_spec only locates the package; importing tensorboard here would slow `import fabric`.
        if find_spec("tensorboard") is None:
            raise ModuleNotFoundError(
                "TensorBoardLogger needs the `tensorboard` package, which is not installed."
                " Run `pip install torchfabric[tensorboard]` (or `pip install tensorboard`),"
                " or use CSVLogger, which needs nothing extra."
            )
        super().__init__(root_dir, name, version)
        self._default_hp_metric = default_hp_metric
        self._prefix = prefix
        self._sub_dir = None if sub_dir is None else os.fspath(sub_dir)
        self._kwargs = kwargs
        self._experiment: SummaryWriter | None = None

    @property
    def sub_dir(self) -> str | None:
        """The directory inside the version directory that is written to, if any."""
        return self._sub_dir

    @property
    def log_dir(self) -> str:
        """The directory (or URL) the event files go to."""
        if self._remote is not None:
            return self._version_dir + (f"/{self._sub_dir.strip('/')}" if self._sub_dir else "")
        return self._local_log_dir

    @property
    def _local_log_dir(self) -> str:
        path = Path(self._local_version_dir, self._sub_dir or "")
        return os.fspath(Path(os.path.expandvars(path)).expanduser())

    @property
    @rank_zero_experiment
    def experiment(self) -> SummaryWriter:
        """The ``SummaryWriter``, created (with its directory) on first use; on other ranks than 0 a dummy."""
        return self._writer()

    def _writer(self) -> SummaryWriter:
        # The methods that write run on rank 0 only (@rank_zero_only) and reach the writer through here.
        if self._experiment is None:
            from torch.utils.tensorboard import SummaryWriter

            self._experiment = SummaryWriter(log_dir=self._local_log_dir, **self._kwargs)
        return self._experiment

    @rank_zero_only
    def log_metrics(
        self, metrics: Mapping[str, float | Tensor | Mapping[str, float | Tensor]], step: int | None = None
    ) -> None:
        """Write each metric as a scalar; a dict value becomes a group of scalars in one chart."""
        for key, value in _add_prefix(metrics, self._prefix, self.LOGGER_JOIN_CHAR).items():
            if isinstance(value, Mapping):
                scalars = {name: _scalar(f"{key}/{name}", v, "TensorBoardLogger") for name, v in value.items()}
                self._writer().add_scalars(key, scalars, step)
            else:
                self._writer().add_scalar(key, _scalar(key, value, "TensorBoardLogger"), step)

    @rank_zero_only
    def log_hyperparams(
        self,
        params: dict[str, Any] | Namespace | Any,
        metrics: Mapping[str, float] | float | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Write ``params`` to the HPARAMS tab, linked to ``metrics`` (or the default ``hp_metric``)."""
        from torch.utils.tensorboard.summary import hparams

        flat = _sanitize(_flatten(_params_to_dict(params, "TensorBoardLogger")))
        if metrics is None:
            metric_dict = {"hp_metric": -1.0} if self._default_hp_metric else {}
        elif isinstance(metrics, Mapping):
            metric_dict = dict(metrics)
        else:
            metric_dict = {"hp_metric": metrics}
        if metric_dict:
            self.log_metrics(metric_dict, 0)
        # The summaries go into this run's own event file. SummaryWriter.add_hparams would open a second
        # writer in a new timestamped directory, which splits one run in two in TensorBoard.
        file_writer = self._writer()._get_file_writer()
        for summary in hparams(flat, metric_dict):
            file_writer.add_summary(summary)

    @rank_zero_only
    def log_graph(self, model: Module, input_array: Tensor | None = None) -> None:
        """Write the graph of ``model`` traced on ``input_array`` (or ``model.example_input_array``)."""
        example = getattr(model, "example_input_array", None) if input_array is None else input_array
        if not isinstance(example, (Tensor, tuple)):
            warnings.warn(
                "TensorBoardLogger.log_graph: no graph was logged because no example input was found."
                " Pass input_array=<tensor or tuple of tensors>, or set model.example_input_array.",
                UserWarning,
                stacklevel=2,
            )
            return
        self._writer().add_graph(model, example)

    @rank_zero_only
    def save(self) -> None:
        """Flush pending events to disk (and upload them, for a URL ``root_dir``)."""
        if self._experiment is not None:
            self._experiment.flush()
            self._upload()

    @rank_zero_only
    def finalize(self, status: str) -> None:
        """Flush and close the event file; a later call to a ``log_*`` method opens a new one."""
        if self._experiment is not None:
            self._experiment.flush()
            self._experiment.close()
            self._experiment = None
            self._upload()
            self._release_mirror()


def _flatten(params: Mapping[str, Any], parent: str = "") -> dict[str, Any]:
    # TensorBoard's HPARAMS table has one flat column per parameter, so nested dicts become "a/b" keys.
    flat: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{parent}/{key}" if parent else str(key)
        if isinstance(value, Namespace):
            value = vars(value)
        if isinstance(value, Mapping) and value:
            flat.update(_flatten(value, name))
        else:
            flat[name] = value
    return flat


def _sanitize(params: Mapping[str, Any]) -> dict[str, Any]:
    # The hparams summary accepts only numbers, strings and bools; everything else is shown as text.
    clean: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        clean[key] = value if isinstance(value, (bool, int, float, str)) else str(value)
    return clean
