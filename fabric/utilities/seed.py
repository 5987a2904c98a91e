"""Seed the random number generators of python, numpy and torch, and hand the seed on to child processes."""

from __future__ import annotations

import logging
import os
import random
import warnings
from typing import Any

import torch

from fabric.utilities.exceptions import FabricValueError

# Child processes (spawned ranks, dataloader workers) inherit the environment, so this is how the seed
# reaches them without any process-wide Python state.
_SEED_ENV = "FABRIC_GLOBAL_SEED"
_WORKERS_ENV = "FABRIC_SEED_WORKERS"
# numpy's legacy global generator only accepts unsigned 32-bit seeds, so that is the range for all three.
_MIN_SEED = 0
_MAX_SEED = 2**32 - 1

log = logging.getLogger(__name__)


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed ``random``, numpy (if installed) and torch, and record the seed for child processes.

    Args:
        seed: the seed. ``None`` reads the ``FABRIC_GLOBAL_SEED`` environment variable, or uses 0 with a
            warning when that is not set either.
        workers: whether dataloader workers derive their own seeds from this one (read by the dataloader
            code through :func:`current_seed_config`).
        verbose: whether to log the chosen seed.

    Returns:
        The seed that was used.
    """
    chosen = _seed_from_env() if seed is None else _as_int(seed)
    if not _MIN_SEED <= chosen <= _MAX_SEED:
        raise FabricValueError(
            f"seed_everything(seed={chosen}): the seed is outside the range numpy accepts"
            f" ({_MIN_SEED} to {_MAX_SEED}). Pass a seed in that range."
        )
    if verbose:
        log.info("Seed set to %d", chosen)
    os.environ[_SEED_ENV] = str(chosen)
    os.environ[_WORKERS_ENV] = "1" if workers else "0"
    random.seed(chosen)
    _seed_numpy(chosen)
    # torch.manual_seed also seeds every CUDA device, so no separate cuda call is needed.
    torch.manual_seed(chosen)
    return chosen


def reset_seed() -> None:
    """Re-seed from the environment if ``seed_everything`` ran earlier (in this or a parent process)."""
    seed, workers = current_seed_config()
    if seed is not None:
        seed_everything(seed, workers=workers, verbose=False)


def current_seed_config() -> tuple[int | None, bool]:
    """Return the seed recorded by ``seed_everything`` (or ``None``) and whether workers are seeded."""
    raw = os.environ.get(_SEED_ENV)
    seed = None if raw is None else _parse_env_seed(raw)
    return seed, os.environ.get(_WORKERS_ENV, "0") == "1"


def _seed_from_env() -> int:
    raw = os.environ.get(_SEED_ENV)
    if raw is None:
        warnings.warn(
            f"seed_everything(seed=None): no seed was given and {_SEED_ENV} is not set, so the seed is 0."
            " Pass seed=<int> to choose one.",
            UserWarning,
            stacklevel=3,
        )
        return 0
    return _parse_env_seed(raw)


def _parse_env_seed(raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise FabricValueError(
            f"{_SEED_ENV}={raw!r}: the environment variable must hold an integer seed."
            f" Set it to an integer such as 42, or unset it."
        ) from None


def _as_int(seed: Any) -> int:
    try:
        return int(seed)
    except (TypeError, ValueError):
        raise FabricValueError(
            f"seed_everything(seed={seed!r}): the seed must be an integer. Pass an int such as 42."
        ) from None


def _seed_numpy(seed: int) -> None:
    # numpy is optional; importing it here keeps `import fabric` from paying for it.
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed)


def pl_worker_init_function(worker_id: int, rank: int | None = None) -> None:
    """The ``worker_init_fn`` fabric gives DataLoaders after ``seed_everything(seed, workers=True)``.

    Seeds ``random``, numpy and torch in the worker from the recorded seed, this process's global rank
    (default: ``rank_zero_only.rank``) and the worker id, so no two workers on any rank repeat each
    other's randomness. Lightning's name; does nothing when ``seed_everything`` has not run.
    """
    from fabric.utilities.data import worker_init_function
    from fabric.utilities.rank_zero import rank_zero_only

    seed, _ = current_seed_config()
    if seed is None:
        return
    worker_init_function(worker_id, rank=rank_zero_only.rank if rank is None else rank, base_seed=seed)
