"""Seed the random number generators of python, numpy and torch, and hand the seed on to child processes."""

from __future__ import annotations

import logging
import os
import random
import warnings
from typing import Any

import torch

from fabric.utilities.exceptions import FabricValueError
from fabric.utilities.rank_zero import _known_rank, rank_prefixed_message

# Child processes (spawned ranks, dataloader workers) inherit the environment, so this is how the seed
# reaches them without any process-wide Python state.
_SEED_ENV = "FABRIC_GLOBAL_SEED"
_WORKERS_ENV = "FABRIC_SEED_WORKERS"
# Lightning Fabric's names for the same two facts. They are written too, and read when ours are absent, so a
# script that mixes `lightning.fabric.seed_everything` with our Fabric (or reads PL_GLOBAL_SEED itself) gets the
# same sampler seed and worker seeding as under Lightning.
_LIGHTNING_SEED_ENV = "PL_GLOBAL_SEED"
_LIGHTNING_WORKERS_ENV = "PL_SEED_WORKERS"
# numpy's legacy global generator only accepts unsigned 32-bit seeds, so that is the range for all three.
_MIN_SEED = 0
_MAX_SEED = 2**32 - 1
_MASK_64 = 2**64 - 1

log = logging.getLogger(__name__)


def seed_everything(seed: int | None = None, workers: bool = False, verbose: bool = True) -> int:
    """Seed ``random``, numpy (if installed) and torch, and record the seed for child processes.

    The seed is recorded in ``FABRIC_GLOBAL_SEED`` and ``PL_GLOBAL_SEED`` (and ``workers`` in
    ``FABRIC_SEED_WORKERS`` and ``PL_SEED_WORKERS``), so that code written for Lightning Fabric finds it too.

    Args:
        seed: the seed. ``None`` reads ``FABRIC_GLOBAL_SEED`` (else ``PL_GLOBAL_SEED``), or uses 0 with a
            warning when neither is set.
        workers: whether dataloader workers derive their own seeds (see :func:`worker_init_function`);
            read by the dataloader code through :func:`current_seed_config`.
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
        # Prefixed with the rank in a multi-process job, as in Lightning: every rank logs its seed.
        log.info(rank_prefixed_message(f"Seed set to {chosen}", _known_rank()))
    for name in (_SEED_ENV, _LIGHTNING_SEED_ENV):
        os.environ[name] = str(chosen)
    for name in (_WORKERS_ENV, _LIGHTNING_WORKERS_ENV):
        os.environ[name] = "1" if workers else "0"
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
    """Return the seed recorded by ``seed_everything`` (or ``None``) and whether workers are seeded.

    Our variables come first; Lightning's are the fallback, for a seed set by ``lightning.fabric.seed_everything``.
    """
    found = _recorded_seed()
    if found is None:
        return None, False
    seed_name, raw = found
    workers_name = _WORKERS_ENV if seed_name == _SEED_ENV else _LIGHTNING_WORKERS_ENV
    return _parse_env_seed(seed_name, raw), os.environ.get(workers_name, "0").strip() == "1"


def worker_init_function(worker_id: int, rank: int | None = None) -> None:
    """Seed torch, ``random`` and numpy inside a DataLoader worker, exactly as Lightning Fabric does.

    Torch gives worker ``i`` the seed ``base + i``, where ``base`` is drawn from the main process's torch
    RNG each time the loader is iterated. ``base`` is equal on every rank when all ranks were seeded alike,
    so the workers of different ranks would repeat each other's augmentations; mixing in the rank fixes that,
    and because ``base`` changes every epoch, non-persistent workers draw afresh each epoch.

    The seeds are derived like Lightning's ``pl_worker_init_function``, so the same global seed gives the
    same worker randomness under both: ``(base << 32) | (worker_id << 16) | rank`` goes through the
    MurmurHash3 64-bit finalizer and then Knuth's MMIX linear congruential generator; its first output seeds
    torch, the next two (the first shifted left by 32 bits, OR-ed with the second) seed ``random``. numpy is
    seeded with four 32-bit words of ``numpy.random.SeedSequence([base, worker_id, rank])``.

    Args:
        worker_id: the worker's index, as the DataLoader passes it.
        rank: the global rank; ``None`` asks ``torch.distributed`` (0 when no process group exists).
    """
    global_rank = _current_rank() if rank is None else rank
    base_seed = torch.initial_seed() - worker_id
    torch_seed, random_high, random_low = _derive_worker_seeds(base_seed, worker_id, global_rank, count=3)
    torch.manual_seed(torch_seed)
    random.seed((random_high << 32) | random_low)
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        return
    np.random.seed(np.random.SeedSequence([base_seed, worker_id, global_rank]).generate_state(4))


# The name Lightning Fabric gives the same function, for scripts that import it from this module.
pl_worker_init_function = worker_init_function


def _derive_worker_seeds(base_seed: int, worker_id: int, rank: int, count: int) -> list[int]:
    """``count`` 64-bit seeds from one worker's identity: a MurmurHash3 finalizer, then an MMIX LCG."""
    # The first shift acts on the full, unmasked key: Lightning does the same, and equal seeds need equal steps.
    state = (base_seed << 32) | (worker_id << 16) | rank
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        state ^= state >> 33
        state = (state * multiplier) & _MASK_64
    state ^= state >> 33
    seeds = []
    for _ in range(count):
        state = (state * 6364136223846793005 + 1) & _MASK_64
        seeds.append(state)
    return seeds


def _current_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _recorded_seed() -> tuple[str, str] | None:
    """The name and raw value of the first seed variable that is set, ours before Lightning's."""
    for name in (_SEED_ENV, _LIGHTNING_SEED_ENV):
        raw = os.environ.get(name)
        if raw is not None:
            return name, raw
    return None


def _seed_from_env() -> int:
    found = _recorded_seed()
    if found is None:
        warnings.warn(
            f"seed_everything(seed=None): no seed was given and neither {_SEED_ENV} nor {_LIGHTNING_SEED_ENV} is"
            " set, so the seed is 0. Pass seed=<int> to choose one.",
            UserWarning,
            stacklevel=3,
        )
        return 0
    return _parse_env_seed(*found)


def _parse_env_seed(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise FabricValueError(
            f"{name}={raw!r}: the environment variable must hold an integer seed."
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
