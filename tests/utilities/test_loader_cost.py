"""A loader from setup_dataloaders does per batch what a plain DataLoader does; its position is computed on a save.

Work is counted (Python calls per batch, state computations, snapshots, gc calls), never timed.
"""

from __future__ import annotations

import collections
import gc
import importlib.util
import multiprocessing
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from fabric import Fabric

needs_torchdata = pytest.mark.skipif(
    importlib.util.find_spec("torchdata") is None, reason="torchdata is not installed (pip install torchfabric[resume])"
)


class _Indexed(Dataset):
    """Sample i is the float i: batches show which samples they hold."""

    def __len__(self) -> int:
        return 37

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([float(index)])


class _WithState(_Indexed):
    """A dataset with a state of its own: torchdata keeps its position as it goes."""

    def state_dict(self) -> dict[str, int]:
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _fabric() -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.seed_everything(3, verbose=False)
    return fabric


def _calls_per_batch(iterator: Iterator[Any], batches: int) -> collections.Counter:
    """Python and C function calls made while taking `batches` batches."""
    calls: collections.Counter = collections.Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            calls[frame.f_code.co_name] += 1
        elif event == "c_call":
            calls[getattr(arg, "__qualname__", "?")] += 1

    sys.setprofile(profile)
    try:
        for _ in range(batches):
            next(iterator)
    finally:
        sys.setprofile(None)
    calls.pop("setprofile", None)
    return calls


@needs_torchdata
@pytest.mark.parametrize("shuffle", [True, False])
def test_a_batch_costs_the_calls_of_a_plain_dataloader(shuffle: bool) -> None:
    torch.manual_seed(0)
    plain = iter(DataLoader(_Indexed(), batch_size=8, shuffle=shuffle))
    loader = _fabric().setup_dataloaders(DataLoader(_Indexed(), batch_size=8, shuffle=shuffle))
    ours = iter(loader)
    next(plain), next(ours)  # the first batch draws the order
    ours_calls, plain_calls = _calls_per_batch(ours, 3), _calls_per_batch(plain, 3)
    # torch's BatchSampler resumes a generator per batch where fabric's calls __next__: one call each.
    assert sum(ours_calls.values()) <= sum(plain_calls.values()), (ours_calls, plain_calls)


@needs_torchdata
@pytest.mark.parametrize("workers", [0, 2])
def test_no_state_is_computed_while_iterating(workers: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from torchdata.stateful_dataloader import stateful_dataloader as sdl

    from fabric.utilities import _replay_sampler, _stateful_loader

    counts: collections.Counter = collections.Counter()

    def spy(cls: Any, name: str) -> None:
        original = getattr(cls, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return original(*args, **kwargs)

        monkeypatch.setattr(cls, name, counted)

    spy(_replay_sampler._BatchIterator, "state_dict")
    spy(_stateful_loader._FabricStatefulDataLoader, "position_state")
    spy(sdl._StatefulMultiProcessingDataLoaderIter, "_take_snapshot")
    spy(sdl._StatefulMultiProcessingDataLoaderIter, "_reset")  # its start-up round trip to every worker
    spy(sdl._StatefulSingleProcessDataLoaderIter, "state_dict")
    loader = _fabric().setup_dataloaders(DataLoader(_Indexed(), batch_size=4, shuffle=True, num_workers=workers))
    assert len([batch for _ in range(2) for batch in loader]) == 20
    assert not counts, f"state work while iterating: {dict(counts)}"


@needs_torchdata
@pytest.mark.parametrize("workers", [0, 2])
def test_mid_epoch_resume_with_the_position_computed_on_save(tmp_path: Path, workers: int) -> None:
    def setup() -> Any:
        fabric = _fabric()
        return fabric, fabric.setup_dataloaders(DataLoader(_Indexed(), batch_size=4, shuffle=True, num_workers=workers))

    def epochs(loader: Any, count: int) -> list[list[float]]:
        return [[v for batch in loader for v in batch.flatten().tolist()] for _ in range(count)]

    reference = epochs(setup()[1], 2)
    fabric, loader = setup()
    iterator = iter(loader)
    first = [v for _ in range(3) for v in next(iterator).flatten().tolist()]
    fabric.save(tmp_path / "ckpt", {"loader": loader})
    saved = torch.load(tmp_path / "ckpt", weights_only=False)["loader"]["ranks"]["0"]
    assert saved["mid_epoch"] and saved["batches"] == 3
    fabric, resumed = setup()
    fabric.load(tmp_path / "ckpt", {"loader": resumed})
    assert first + epochs(resumed, 1)[0] == reference[0]
    assert epochs(resumed, 1) == reference[1:]


@needs_torchdata
@pytest.mark.parametrize("workers", [0, 2, "persistent"])
def test_a_loop_that_ended_without_a_step_after_its_last_batch_saves_a_boundary(workers: Any) -> None:
    fabric = _fabric()
    model = nn.Linear(1, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    persistent = workers == "persistent"
    loader = fabric.setup_dataloaders(
        DataLoader(_Indexed(), batch_size=4, num_workers=2 if persistent else workers, persistent_workers=persistent)
    )
    for epoch in range(2):
        for index, _ in enumerate(loader):
            if index % 3 == 2:  # gradient accumulation: no step after the epoch's last (10th) batch
                optimizer.step()
        state = loader.state_dict()["ranks"]["0"]
        assert not state["mid_epoch"] and state["epoch"] == epoch + 1, "the loop was done with every batch"


@needs_torchdata
def test_persistent_workers_resume_mid_epoch(tmp_path: Path) -> None:
    def setup() -> Any:
        fabric = _fabric()
        loader = DataLoader(_Indexed(), batch_size=4, shuffle=True, num_workers=2, persistent_workers=True)
        return fabric, fabric.setup_dataloaders(loader)

    reference = [v for batch in setup()[1] for v in batch.flatten().tolist()]
    fabric, loader = setup()
    iterator = iter(loader)
    first = [v for _ in range(4) for v in next(iterator).flatten().tolist()]
    fabric.save(tmp_path / "ckpt", {"loader": loader})
    fabric, resumed = setup()
    fabric.load(tmp_path / "ckpt", {"loader": resumed})
    assert first + [v for batch in resumed for v in batch.flatten().tolist()] == reference


def test_a_position_saved_in_torchdatas_batch_sampler_format_still_loads() -> None:
    from torch.utils.data import RandomSampler

    from fabric.utilities._replay_sampler import _BatchIterator, _ReplaySampler

    sampler = _ReplaySampler(RandomSampler(range(20)))
    start = torch.get_rng_state()
    expected = [*RandomSampler(range(20))][8:12]
    iterator = _BatchIterator(sampler, 4, drop_last=False)
    # What fabric saved before: torchdata's BatchSampler state around the replay sampler's own.
    iterator.load_state_dict({"samples_yielded": 8, "sampler_iter_state": {"start": start, "yielded": 8}})
    assert next(iterator) == expected and iterator.batches == 3


@needs_torchdata
def test_a_dataset_with_its_own_state_keeps_torchdatas_position() -> None:
    loader = _fabric().setup_dataloaders(DataLoader(_WithState(), batch_size=4, shuffle=True))
    assert loader.dataloader.position_state(0) is None
    assert type(iter(loader)).__name__ == "_StatefulSingleProcessDataLoaderIter"


# -- the batch in hand when a save comes before the step (issue 18: a preemption check at the top of the body) ----
def _train(path: Path, save_at: int | None, placement: str, resume: bool) -> dict[str, torch.Tensor]:
    fabric = _fabric()
    model = nn.Linear(1, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    loader = fabric.setup_dataloaders(DataLoader(_Indexed(), batch_size=4, shuffle=True))
    state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
    if resume:
        fabric.load(path, state)
    while state["step"] < 20:
        for batch in loader:
            if placement == "top" and state["step"] == save_at:
                fabric.save(path, state)  # the batch in hand is not used
                return {}
            fabric.backward(model(batch).pow(2).mean() * 1e-3)
            optimizer.step()
            optimizer.zero_grad()
            state["step"] += 1
            if placement == "after" and state["step"] == save_at:
                fabric.save(path, state)
                return {}
            if state["step"] == 20:
                break
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@needs_torchdata
@pytest.mark.parametrize("placement", ["top", "after"])
@pytest.mark.parametrize("save_at", [4, 9, 10])  # inside an epoch, at its last batch, at the next epoch's first
def test_a_save_before_or_after_the_step_resumes_bit_for_bit(tmp_path: Path, placement: str, save_at: int) -> None:
    full = _train(tmp_path / "unused", None, placement, resume=False)
    _train(tmp_path / "ckpt", save_at, placement, resume=False)
    resumed = _train(tmp_path / "ckpt", None, placement, resume=True)
    assert all(torch.equal(full[key], resumed[key]) for key in full)


@needs_torchdata
def test_the_batch_in_hand_counts_once_a_step_has_followed_it(tmp_path: Path) -> None:
    fabric = _fabric()
    model = nn.Linear(1, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loader = fabric.setup_dataloaders(DataLoader(_Indexed(), batch_size=4))
    iterator = iter(loader)
    next(iterator), next(iterator)
    assert loader.state_dict()["ranks"]["0"]["batches"] == 1, "the second batch was not used by a step"
    optimizer.step()
    assert loader.state_dict()["ranks"]["0"]["batches"] == 2


@needs_torchdata
def test_an_optimizer_set_up_after_the_loader_is_watched_from_the_next_epoch() -> None:
    fabric = _fabric()
    loader = fabric.setup_dataloaders(DataLoader(_Indexed(), batch_size=4))
    model = nn.Linear(1, 1)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    iterator = iter(loader)
    next(iterator)
    assert loader.state_dict()["ranks"]["0"]["batches"] == 0
    optimizer.step()
    assert loader.state_dict()["ranks"]["0"]["batches"] == 1


@needs_torchdata
def test_a_loop_without_optimizers_counts_every_batch_given_out() -> None:
    loader = _fabric().setup_dataloaders(DataLoader(_Indexed(), batch_size=4))
    iterator = iter(loader)
    next(iterator), next(iterator)
    assert loader.state_dict()["ranks"]["0"]["batches"] == 2


@needs_torchdata
def test_a_loader_that_cannot_step_back_warns_when_saved_before_the_step() -> None:
    fabric = _fabric()
    model = nn.Linear(1, 1)
    model, _optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01))
    loader = fabric.setup_dataloaders(DataLoader(_WithState(), batch_size=4))
    iterator = iter(loader)
    next(iterator)
    with pytest.warns(UserWarning, match=r"holds a batch that no optimizer step has used yet.*after optimizer.step"):
        loader.state_dict()


# -- freeze_gc ----------------------------------------------------------------------------------------------------
def _gc_calls(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(gc, "freeze", lambda: calls.append("freeze"))
    monkeypatch.setattr(gc, "unfreeze", lambda: calls.append("unfreeze"))
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 0)
    return calls


@pytest.mark.parametrize(
    ("freeze_gc", "workers", "expected"),
    [
        (True, 2, ["freeze", "unfreeze"] * 2),  # around each epoch's fork
        (False, 2, []),  # the default: the process's GC is left alone
        (True, 0, []),  # no workers, nothing forked
    ],
)
def test_freeze_gc_freezes_only_around_forking_workers_when_asked(
    monkeypatch: pytest.MonkeyPatch, freeze_gc: bool, workers: int, expected: list[str]
) -> None:
    calls = _gc_calls(monkeypatch)
    context = "fork" if workers else None
    loader = DataLoader(_Indexed(), batch_size=4, num_workers=workers, multiprocessing_context=context)
    loader = _fabric().setup_dataloaders(loader, freeze_gc=freeze_gc)
    for _ in range(2):
        iter(loader)
    assert calls == expected


@pytest.mark.parametrize(("context", "forks"), [("fork", True), ("spawn", False), ("forkserver", False)])
def test_only_the_fork_start_method_counts_as_forking(context: str, forks: bool) -> None:
    from fabric._dataloader import _forks_workers

    for given in (context, multiprocessing.get_context(context)):
        assert _forks_workers(DataLoader(_Indexed(), num_workers=2, multiprocessing_context=given)) is forks


def test_freeze_gc_leaves_a_heap_the_program_froze_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _gc_calls(monkeypatch)
    monkeypatch.setattr(gc, "get_freeze_count", lambda: 10)
    loader = _fabric().setup_dataloaders(
        DataLoader(_Indexed(), batch_size=4, num_workers=2, multiprocessing_context="fork"), freeze_gc=True
    )
    iter(loader)
    assert calls == []


def test_freeze_gc_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"setup_dataloaders\(freeze_gc='yes'\): freeze_gc is a switch"):
        _fabric().setup_dataloaders(DataLoader(_Indexed()), freeze_gc="yes")  # type: ignore[arg-type]
