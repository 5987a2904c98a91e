"""What a spawned worker gets back of its parent's process-wide settings (the launcher's _GlobalState)."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from fabric.strategies.launchers.multiprocessing import _deterministic_flags, _GlobalState


@pytest.fixture
def flags_kept() -> Iterator[None]:
    enabled, warn_only = _deterministic_flags()
    yield
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.mark.usefixtures("flags_kept")
def test_restore_brings_back_the_rng_states_and_deterministic_flags() -> None:
    torch.use_deterministic_algorithms(True, warn_only=True)
    state = _GlobalState.capture()
    expected_torch, expected_python = torch.rand(3), random.random()
    torch.use_deterministic_algorithms(False)
    torch.rand(5), random.random()
    state.restore()
    assert _deterministic_flags() == (True, True)
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_python


@pytest.mark.usefixtures("flags_kept")
def test_restore_leaves_unchanged_deterministic_flags_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    # Setting them imports torch._inductor's config and torch._dynamo: seconds in every spawned worker.
    torch.use_deterministic_algorithms(False)
    state = _GlobalState.capture()
    calls: list[object] = []
    monkeypatch.setattr(torch, "use_deterministic_algorithms", lambda *args, **kwargs: calls.append((args, kwargs)))
    state.restore()
    assert calls == []
