"""Run functions, warnings and log messages on global rank 0 only (Lightning's ``rank_zero_*`` helpers).

Lightning keeps the rank in a module attribute that its strategies overwrite at launch. fabric keeps no
such process-wide state: ``rank_zero_only.rank`` is read from the initialised ``torch.distributed``
group, else from torch_xla's runtime in a process its launcher started, else from the scheduler that
started the process (torchrun, SLURM, Kubeflow, LSF), else 0.
Assigning ``rank_zero_only.rank = N`` still works, as in Lightning, and then wins over all of those.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any, TypeVar, overload

import torch.distributed as dist

log = logging.getLogger(__name__)

_T = TypeVar("_T")


def _detected_rank() -> int:
    """This process's global rank as far as it can be known without any Fabric object (0 for a plain process)."""
    rank = _known_rank()
    return 0 if rank is None else rank


def _known_rank() -> int | None:
    """The global rank a process group, launcher or cluster gives this process; None for a plain process."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    # torch_xla's launched processes join no torch.distributed group; its runtime knows their ranks. Asked every
    # time (not cached with the environment): the answer is the runtime's, not a variable's. It needs torch_xla
    # imported, so a process without it skips even importing the function (about 1 us per read).
    if "torch_xla" in sys.modules:
        # Imported here: fabric.environments imports fabric.utilities, which imports this module.
        from fabric.environments.xla import launched_xla_rank

        xla_rank = launched_xla_rank()
        if xla_rank is not None:
            return xla_rank
    return _environment_rank()


# What `_environment_rank` last saw: a copy of the environment, and the rank detected from it.
_environment_cache: tuple[dict[Any, Any], int | None] | None = None


def _environment_rank() -> int | None:
    """`_rank_from_environment()`, computed again only when the environment changed.

    Detection reads about twenty variables through four cluster environments: 14 us per call, which
    `rank_zero_only` (CSVLogger.log_metrics, every step) paid in every process without a group. Comparing the
    environment with a copy is one C-level dict comparison (about 0.4 us), and any change, by a test, a launcher or
    the user, is seen at the next call.
    """
    global _environment_cache
    # os.environ's own dict (CPython's private name, on every platform it supports); without it, no cache.
    current = getattr(os.environ, "_data", None)
    if not isinstance(current, dict):
        return _rank_from_environment()
    cached = _environment_cache
    if cached is not None and cached[0] == current:
        return cached[1]
    rank = _rank_from_environment()
    _environment_cache = (dict(current), rank)
    return rank


def _rank_from_environment() -> int | None:
    """The global rank a scheduler or fabric's launcher gives this process through its variables, if any."""
    from fabric.environments import KubeflowEnvironment, LSFEnvironment, SLURMEnvironment, TorchElasticEnvironment

    # MPI is left out on purpose: detecting it imports mpi4py, which initialises MPI as a side effect.
    for env_cls in (TorchElasticEnvironment, SLURMEnvironment, KubeflowEnvironment, LSFEnvironment):
        if env_cls.detect():
            rank = env_cls().global_rank()
            return 0 if rank is None else rank
    # A child that fabric.launch() started, before its group exists (Lightning reads LOCAL_RANK here).
    from fabric.strategies.launchers._run_worker import LAUNCHED_RANK_ENV

    launched = os.environ.get(LAUNCHED_RANK_ENV)
    return None if launched is None else int(launched)


class _RankZeroOnly:
    """The ``rank_zero_only`` decorator: ``rank_zero_only(fn, default=None)`` runs ``fn`` on global rank 0 only.

    On other ranks the call returns ``default``. ``rank_zero_only.rank`` is the rank the decision uses.
    """

    def __init__(self) -> None:
        self._rank: int | None = None

    @property
    def rank(self) -> int:
        """The rank set by the user, else the detected global rank of this process."""
        return _detected_rank() if self._rank is None else self._rank

    @rank.setter
    def rank(self, value: int | None) -> None:
        # None hands the decision back to detection, which a test or a library may want.
        self._rank = None if value is None else int(value)

    @overload
    def __call__(self, fn: Callable[..., _T]) -> Callable[..., _T | None]: ...

    @overload
    def __call__(self, fn: Callable[..., _T], default: _T) -> Callable[..., _T]: ...

    def __call__(self, fn: Callable[..., Any], default: Any = None) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if self.rank == 0:
                return fn(*args, **kwargs)
            return default

        return wrapped


rank_zero_only = _RankZeroOnly()


class LightningDeprecationWarning(DeprecationWarning):
    """The category of ``rank_zero_deprecation`` warnings (Lightning's name, kept for ``filterwarnings``)."""


# Lightning counts ``stacklevel`` through one more helper frame than these functions have, so that its default
# (4) names the line that called the helper; these subtract that frame, so the same value means the same line.
@rank_zero_only
def rank_zero_debug(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.debug`` on global rank 0 only; the record names the caller's line."""
    log.debug(*args, stacklevel=stacklevel - 1, **kwargs)


@rank_zero_only
def rank_zero_info(*args: Any, stacklevel: int = 4, **kwargs: Any) -> None:
    """``logging.info`` on global rank 0 only; the record names the caller's line."""
    log.info(*args, stacklevel=stacklevel - 1, **kwargs)


@rank_zero_only
def rank_zero_warn(message: str | Warning, stacklevel: int = 4, **kwargs: Any) -> None:
    """``warnings.warn`` on global rank 0 only; the warning names the caller's line."""
    warnings.warn(message, stacklevel=stacklevel - 1, **kwargs)


def rank_zero_deprecation(message: str | Warning, stacklevel: int = 5, **kwargs: Any) -> None:
    """A ``LightningDeprecationWarning`` (or the given ``category``) on global rank 0 only."""
    category = kwargs.pop("category", LightningDeprecationWarning)
    rank_zero_warn(message, stacklevel=stacklevel, category=category, **kwargs)


def rank_prefixed_message(message: str, rank: int | None) -> str:
    """``message`` with a ``[rank: N]`` prefix when ``rank`` is given."""
    return message if rank is None else f"[rank: {rank}] {message}"


class WarningCache(set):
    """Emits each distinct message once (on global rank 0), however often it is called."""

    def warn(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        """Warn the first time ``message`` is seen."""
        if message not in self:
            self.add(message)
            rank_zero_warn(message, stacklevel=stacklevel, **kwargs)

    def deprecation(self, message: str, stacklevel: int = 6, **kwargs: Any) -> None:
        """Emit a deprecation warning the first time ``message`` is seen."""
        if message not in self:
            self.add(message)
            rank_zero_deprecation(message, stacklevel=stacklevel, **kwargs)

    def info(self, message: str, stacklevel: int = 5, **kwargs: Any) -> None:
        """Log at info level the first time ``message`` is seen."""
        if message not in self:
            self.add(message)
            rank_zero_info(message, stacklevel=stacklevel, **kwargs)


def _get_rank() -> int:
    """This process's global rank as the launcher or cluster set it (0 for a plain process)."""
    return _detected_rank()


__all__ = [
    "LightningDeprecationWarning",
    "WarningCache",
    "rank_prefixed_message",
    "rank_zero_debug",
    "rank_zero_deprecation",
    "rank_zero_info",
    "rank_zero_only",
    "rank_zero_warn",
]
