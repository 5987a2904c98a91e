"""Tests for seeding python, numpy and torch and handing the seed on through the environment."""

from __future__ import annotations

import os
import random

import numpy as np
import pytest
import torch

from fabric.utilities.seed import current_seed_config, reset_seed, seed_everything


@pytest.fixture(autouse=True)
def _clean_seed_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # setenv first so monkeypatch records the variables and removes what seed_everything writes.
    for name in ("FABRIC_GLOBAL_SEED", "FABRIC_SEED_WORKERS"):
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
