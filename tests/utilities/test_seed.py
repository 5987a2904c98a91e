"""Tests for seeding python, numpy and torch and handing the seed on through the environment."""

from __future__ import annotations

import itertools
import os
import random
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from fabric.utilities.seed import (
    current_seed_config,
    pl_worker_init_function,
    reset_seed,
    seed_everything,
    worker_init_function,
)

_SEED_VARIABLES = ("FABRIC_GLOBAL_SEED", "FABRIC_SEED_WORKERS", "PL_GLOBAL_SEED", "PL_SEED_WORKERS")


@pytest.fixture(autouse=True)
def _clean_seed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # setenv first so monkeypatch records the variables and removes what seed_everything writes.
    for name in _SEED_VARIABLES:
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)


def _draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(4)


def test_same_seed_gives_same_draws() -> None:
    assert seed_everything(123) == 123
    first = _draws()
    seed_everything(123)
    second = _draws()
    assert first[0] == second[0]
    assert first[1] == second[1]
    assert torch.equal(first[2], second[2])


def test_different_seeds_give_different_draws() -> None:
    seed_everything(1)
    first = _draws()
    seed_everything(2)
    second = _draws()
    assert first[0] != second[0]
    assert not torch.equal(first[2], second[2])


def test_records_seed_and_workers_in_env() -> None:
    seed_everything(7, workers=True)
    assert os.environ["FABRIC_GLOBAL_SEED"] == "7"
    assert os.environ["FABRIC_SEED_WORKERS"] == "1"
    assert current_seed_config() == (7, True)
    seed_everything(8)
    assert os.environ["FABRIC_SEED_WORKERS"] == "0"
    assert current_seed_config() == (8, False)


def test_none_reads_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_GLOBAL_SEED", "99")
    assert seed_everything() == 99


def test_none_without_env_uses_zero_and_warns() -> None:
    with pytest.warns(UserWarning, match="no seed was given"):
        assert seed_everything() == 0


def test_invalid_env_seed_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_GLOBAL_SEED", "abc")
    with pytest.raises(ValueError, match=r"FABRIC_GLOBAL_SEED='abc'.*must hold an integer"):
        seed_everything()


@pytest.mark.parametrize("seed", [-1, 2**32])
def test_out_of_range_seed_raises(seed: int) -> None:
    with pytest.raises(ValueError, match=rf"seed_everything\(seed={seed}\): the seed is outside the range"):
        seed_everything(seed)


def test_non_integer_seed_raises() -> None:
    with pytest.raises(ValueError, match=r"seed_everything\(seed='x'\): the seed must be an integer"):
        seed_everything("x")  # type: ignore[arg-type]


def test_no_config_before_seeding() -> None:
    assert current_seed_config() == (None, False)


def test_reset_seed_reseeds_from_env() -> None:
    seed_everything(5, workers=True)
    expected = torch.rand(3)
    torch.manual_seed(1000)
    reset_seed()
    assert torch.equal(torch.rand(3), expected)
    assert current_seed_config() == (5, True)


def test_reset_seed_without_seed_does_nothing() -> None:
    torch.manual_seed(11)
    expected = torch.rand(2)
    torch.manual_seed(11)
    reset_seed()
    assert torch.equal(torch.rand(2), expected)
    assert current_seed_config() == (None, False)


def test_records_seed_under_lightnings_names_too() -> None:
    seed_everything(7, workers=True)
    assert (os.environ["PL_GLOBAL_SEED"], os.environ["PL_SEED_WORKERS"]) == ("7", "1")
    seed_everything(8)
    assert (os.environ["PL_GLOBAL_SEED"], os.environ["PL_SEED_WORKERS"]) == ("8", "0")


def test_lightnings_variables_are_read_when_ours_are_absent(monkeypatch: pytest.MonkeyPatch) -> None:
    # What lightning.fabric.seed_everything(3, workers=True) leaves behind.
    monkeypatch.setenv("PL_GLOBAL_SEED", "3")
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    assert current_seed_config() == (3, True)
    assert seed_everything() == 3
    monkeypatch.setenv("PL_GLOBAL_SEED", "4")
    monkeypatch.setenv("PL_SEED_WORKERS", "0")
    monkeypatch.delenv("FABRIC_GLOBAL_SEED")
    reset_seed()
    assert current_seed_config() == (4, False)


def test_our_variables_win_over_lightnings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FABRIC_GLOBAL_SEED", "5")
    monkeypatch.setenv("FABRIC_SEED_WORKERS", "0")
    monkeypatch.setenv("PL_GLOBAL_SEED", "6")
    monkeypatch.setenv("PL_SEED_WORKERS", "1")
    assert current_seed_config() == (5, False)
    assert seed_everything() == 5


def test_invalid_lightning_env_seed_names_that_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PL_GLOBAL_SEED", "1.5")
    with pytest.raises(ValueError, match=r"PL_GLOBAL_SEED='1.5'.*must hold an integer"):
        current_seed_config()


def _worker_draws(worker_id: int, rank: int | None, process_seed: int = 1234) -> tuple[float, ...]:
    torch.manual_seed(process_seed + worker_id)  # what torch sets in worker `worker_id` before worker_init_fn
    worker_init_function(worker_id, rank=rank)
    return torch.rand(1).item(), random.random(), float(np.random.rand())


def test_worker_seeds_are_distinct_per_worker_and_rank_and_reproducible() -> None:
    pairs = list(itertools.product(range(3), range(3)))
    results = [_worker_draws(worker, rank) for worker, rank in pairs]
    for library in range(3):
        assert len({result[library] for result in results}) == len(pairs)
    assert [_worker_draws(worker, rank) for worker, rank in pairs] == results
    assert _worker_draws(0, 0, process_seed=99) != _worker_draws(0, 0)  # the next epoch's workers draw afresh


def test_worker_seeds_follow_lightnings_derivation() -> None:
    # Lightning Fabric 2.6's pl_worker_init_function with torch.initial_seed() == base + worker_id: the
    # hash-and-LCG sequence of (base, worker_id, rank) seeds torch with its first value and `random` with
    # (second << 32) | third; numpy gets SeedSequence([base, worker_id, rank]).generate_state(4).
    # The constants are that sequence for base=1234, worker_id=1, rank=2, as Lightning computes it.
    first, second, third = 14906621690662491738, 10692265455305266131, 99456155804018968
    torch.manual_seed(1234 + 1)
    worker_init_function(1, rank=2)
    assert torch.initial_seed() == first
    assert random.getstate() == random.Random((second << 32) | third).getstate()
    expected_numpy = np.random.RandomState(np.random.SeedSequence([1234, 1, 2]).generate_state(4))
    assert np.random.rand() == expected_numpy.rand()


def test_worker_seeds_equal_lightnings_for_a_64_bit_base() -> None:
    lightning_seed = pytest.importorskip("lightning.fabric.utilities.seed")
    ours, theirs = [], []
    for function, out in ((worker_init_function, ours), (lightning_seed.pl_worker_init_function, theirs)):
        for worker_id, rank in ((0, 0), (3, 7), (1, 1)):
            torch.manual_seed(2**63 + 5 + worker_id)
            function(worker_id, rank=rank)
            out.append((torch.rand(2).tolist(), random.random(), float(np.random.rand())))
    assert ours == theirs


def test_lightnings_name_is_the_same_function() -> None:
    assert pl_worker_init_function is worker_init_function


def test_worker_rank_defaults_to_the_process_group_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not dist.is_initialized()
    assert _worker_draws(0, None) == _worker_draws(0, 0)  # no process group: rank 0
    # A worker forked from rank 1 of a live group sees that group's rank.
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    assert _worker_draws(0, None) == _worker_draws(0, 1) != _worker_draws(0, 0)


def test_worker_init_function_works_without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numpy", None)  # makes `import numpy` raise ImportError
    torch.manual_seed(0)
    worker_init_function(0, rank=0)
    first = torch.rand(1).item()
    torch.manual_seed(0)
    worker_init_function(0, rank=1)
    assert torch.rand(1).item() != first


def _seed_messages(caplog: pytest.LogCaptureFixture, seed_fn: object, logger: str) -> list[str]:
    caplog.clear()
    with caplog.at_level("INFO", logger=logger):
        seed_fn(7)  # type: ignore[operator]
    return [r.getMessage() for r in caplog.records if r.name == logger]


@pytest.mark.usefixtures("no_cluster_env")
def test_seed_message_names_the_rank_in_a_multi_process_job(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Every rank logs its seed (a Hydra app shows all of them); Lightning prefixes the rank where a launcher
    # named one, and not in a plain process.
    assert _seed_messages(caplog, seed_everything, "fabric.utilities.seed") == ["Seed set to 7"]
    torchrun = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    assert _seed_messages(caplog, seed_everything, "fabric.utilities.seed") == ["[rank: 1] Seed set to 7"]
    lightning_seed = pytest.importorskip("lightning.fabric.utilities.seed")
    assert _seed_messages(caplog, lightning_seed.seed_everything, lightning_seed.__name__) == [
        "[rank: 1] Seed set to 7"
    ]
