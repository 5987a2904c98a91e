"""The interface every experiment logger implements, and helpers the built-in loggers share."""

from __future__ import annotations

import dataclasses
import functools
import os
from abc import ABC, abstractmethod
from argparse import Namespace
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from torch import Tensor
from torch.nn import Module

from fabric.utilities.exceptions import FabricTypeError, FabricValueError
from fabric.utilities.rank_zero import rank_zero_only

if TYPE_CHECKING:
    from fabric.loggers._remote import RemoteDirectory


class Logger(ABC):
    """Records the metrics and hyperparameters of one experiment.

    The built-in loggers write on global rank 0 only, as Lightning Fabric's do: on other ranks their ``log_*``,
    ``save`` and ``finalize`` do nothing and ``experiment`` is an object whose methods do nothing (see
    ``rank_zero_experiment``), so no process but rank 0 creates a directory. They create directories on their
    first write, never in ``__init__``. A logger of your own decides itself (``@rank_zero_only``).
    """

    @property
    @abstractmethod
    def name(self) -> str | None:
        """The experiment name."""

    @property
    @abstractmethod
    def version(self) -> int | str | None:
        """The experiment version."""

    @property
    def root_dir(self) -> str | None:
        """The directory all experiments of this logger live under, if it writes locally."""
        return None

    @property
    def log_dir(self) -> str | None:
        """The directory this experiment writes to, if it writes locally."""
        return None

    @property
    def group_separator(self) -> str:
        """The character that separates a metric group from the metric name, as in ``train/loss``."""
        return "/"

    @abstractmethod
    def log_metrics(self, metrics: Mapping[str, float | Tensor], step: int | None = None) -> None:
        """Record metric values, optionally at a given step."""

    @abstractmethod
    def log_hyperparams(self, params: dict[str, Any] | Namespace | Any, *args: Any, **kwargs: Any) -> None:
        """Record the hyperparameters of the experiment."""

    def log_graph(self, model: Module, input_array: Tensor | None = None) -> None:  # noqa: B027
        """Record the computational graph of ``model``; loggers that cannot do so ignore the call."""

    def save(self) -> None:  # noqa: B027
        """Write anything still buffered to storage."""

    def finalize(self, status: str) -> None:
        """Finish the experiment; ``status`` says how it ended (for example ``"success"``)."""
        self.save()


_Experiment = TypeVar("_Experiment")


def rank_zero_experiment(fn: Callable[[Any], _Experiment]) -> Callable[[Any], _Experiment | _DummyExperiment]:
    """Decorate a logger's ``experiment`` getter: rank 0 gets the real experiment, other ranks a _DummyExperiment.

    The getter itself runs on rank 0 only, so the other ranks never create the experiment's directory or files.
    """

    @functools.wraps(fn)
    def experiment(self: Any) -> _Experiment | _DummyExperiment:
        if rank_zero_only.rank > 0:
            return _DummyExperiment()
        return fn(self)

    return experiment


class _DummyExperiment:
    """The experiment of a rank other than 0: every method, item and item assignment does nothing."""

    def nop(self, *args: Any, **kwargs: Any) -> None:
        """Do nothing; every attribute is this method."""

    def __getattr__(self, _: str) -> Callable[..., None]:
        return self.nop

    def __getitem__(self, index: Any) -> _DummyExperiment:
        # So that logger.experiment[0].add_image(...) does nothing too.
        return self

    def __setitem__(self, *args: Any) -> None:
        pass


class _VersionedLogger(Logger):
    """Directory layout shared by the file loggers: ``root_dir/name/version_N``."""

    def __init__(self, root_dir: str | Path, name: str | None, version: int | str | None) -> None:
        from fabric.io import _fsspec

        self._remote: RemoteDirectory | None = None
        if _fsspec.is_url(root_dir):
            from fabric.loggers._remote import RemoteDirectory

            # Written through a local mirror and uploaded on save; never a local folder named 's3:'.
            self._remote = RemoteDirectory(str(root_dir), f"{type(self).__name__}(root_dir={str(root_dir)!r})")
            self._root_dir = self._remote.url
        else:
            self._root_dir = os.fspath(_fsspec.local(root_dir))
        self._name = name or ""
        self._version = version

    @property
    def name(self) -> str:
        """The experiment name."""
        return self._name

    @property
    def version(self) -> int | str:
        """The experiment version, chosen on first access when not given."""
        if self._version is None:
            # Chosen once: later accesses must not move to a new directory once this one exists.
            if self._remote is not None:
                self._version = _next_version_of(self._remote.child_names(self._name))
            else:
                self._version = _next_version(Path(self._root_dir, self._name))
        return self._version

    @property
    def root_dir(self) -> str:
        """The directory (or URL) experiments are saved under."""
        return self._root_dir

    @property
    def _version_dir(self) -> str:
        if self._remote is not None:
            return self._remote.join(self._name, _version_dir_name(self.version))
        return os.fspath(Path(self._root_dir, self._name, _version_dir_name(self.version)))

    @property
    def _local_version_dir(self) -> str:
        """Where the files are written: the version directory, or its local mirror for a URL."""
        if self._remote is not None:
            return os.fspath(self._remote.local(self._name, _version_dir_name(self.version)))
        return self._version_dir

    def _upload(self) -> None:
        """For a URL: copy the mirrored files of this version to the store."""
        if self._remote is not None:
            self._remote.upload(self._name, _version_dir_name(self.version))

    def _release_mirror(self) -> None:
        """For a URL, once uploaded: remove the local mirror (a later write starts a new one)."""
        if self._remote is not None:
            self._remote.release()


def _next_version(directory: Path) -> int:
    """Return one more than the highest ``version_N`` directory under ``directory``, or 0 if none."""
    if not directory.is_dir():
        return 0
    return _next_version_of([child.name for child in directory.iterdir() if child.is_dir()])


def _next_version_of(names: list[str]) -> int:
    prefix = "version_"
    versions = [int(n[len(prefix) :]) for n in names if n.startswith(prefix) and n[len(prefix) :].isdigit()]
    return max(versions, default=-1) + 1


def _version_dir_name(version: int | str) -> str:
    # A string version is used verbatim so users can name runs; an int becomes Lightning's version_N.
    return version if isinstance(version, str) else f"version_{version}"


def _add_prefix(metrics: Mapping[str, Any], prefix: str, separator: str) -> dict[str, Any]:
    if not prefix:
        return dict(metrics)
    return {f"{prefix}{separator}{key}": value for key, value in metrics.items()}


def _params_to_dict(params: Any, caller: str) -> dict[str, Any]:
    """Turn the hyperparameter forms users pass (dict, Namespace, dataclass, None) into a plain dict."""
    if params is None:
        return {}
    if isinstance(params, Namespace):
        return vars(params).copy()
    if isinstance(params, Mapping):
        return dict(params)
    if dataclasses.is_dataclass(params) and not isinstance(params, type):
        return {field.name: getattr(params, field.name) for field in dataclasses.fields(params)}
    raise FabricTypeError(
        f"{caller}.log_hyperparams(params={type(params).__name__}): hyperparameters must be a dict,"
        " an argparse.Namespace or a dataclass instance. Pass one of those, for example vars(obj)."
    )


def _scalar(name: str, value: Any, caller: str) -> Any:
    """Return a tensor metric as a python number; other values pass through unchanged."""
    if not isinstance(value, Tensor):
        return value
    if value.numel() != 1:
        raise FabricValueError(
            f"{caller}.log_metrics({name!r}=tensor of shape {tuple(value.shape)}): a metric must be a single"
            " number. Reduce it first, for example with .mean(), or log each element under its own name."
        )
    return value.item()
