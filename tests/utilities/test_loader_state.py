"""Saving and restoring the position of loaders from setup_dataloaders, in one process, through fabric.save/load."""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, SubsetRandomSampler, WeightedRandomSampler

from fabric import Fabric
from fabric.utilities import _loader_state
from fabric.utilities._replay_sampler import _ReplaySampler


class _Counting(Dataset):
    """Sample i is i; counts the samples read, to show that fast-forwarding reads none."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        self.reads += 1
        return index


class _MyLoader(DataLoader):
    pass


needs_torchdata = pytest.mark.skipif(
    importlib.util.find_spec("torchdata") is None, reason="torchdata is not installed (pip install torchfabric[resume])"
)


@pytest.fixture(autouse=True)
def _single_process_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)


def _fabric(seed: int = 5) -> Fabric:
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.seed_everything(seed, verbose=False)
    return fabric


def _setup(fabric: Fabric, n: int = 23, batch_size: int = 4, **kwargs: Any) -> Any:
    kwargs.setdefault("shuffle", True)
    return fabric.setup_dataloaders(DataLoader(_Counting(n), batch_size=batch_size, **kwargs))


def _take(iterator: Iterator[Any], count: int) -> list[list[int]]:
    return [next(iterator).tolist() for _ in range(count)]


def _epochs(loader: Any, count: int) -> list[list[list[int]]]:
    return [[batch.tolist() for batch in loader] for _ in range(count)]


@needs_torchdata
def test_loader_is_rebuilt_as_a_stateful_dataloader() -> None:
    from torchdata.stateful_dataloader import StatefulDataLoader

    loader = _setup(_fabric())
    assert isinstance(loader.dataloader, StatefulDataLoader)
    assert isinstance(loader.dataloader, DataLoader)


@needs_torchdata
def test_mid_epoch_resume_continues_with_the_next_batch_and_later_epochs(tmp_path: Path) -> None:
    reference = _epochs(_setup(_fabric()), 3)
    fabric = _fabric()
    loader = _setup(fabric)
    iterator = iter(loader)
    first = _take(iterator, 2)
    fabric.save(tmp_path / "ckpt", {"loader": loader})

    fabric = _fabric(seed=99)  # another global RNG: the saved state alone decides the order
    resumed = _setup(fabric)
    fabric.load(tmp_path / "ckpt", {"loader": resumed})
    rest = [batch.tolist() for batch in resumed]
    assert first + rest == reference[0]
    assert _epochs(resumed, 2) == reference[1:]


@needs_torchdata
def test_fast_forward_reads_no_skipped_sample(tmp_path: Path) -> None:
    fabric = _fabric()
    loader = _setup(fabric)
    iterator = iter(loader)
    _take(iterator, 4)
    fabric.save(tmp_path / "ckpt", {"loader": loader})
    resumed = _setup(fabric)
    fabric.load(tmp_path / "ckpt", {"loader": resumed})
    dataset = resumed.dataloader.dataset
    rest = list(resumed)
    assert len(rest) == 2 and dataset.reads == 7, "only the 7 samples of the last 2 batches were read"


@needs_torchdata
def test_saving_does_not_change_the_order(tmp_path: Path) -> None:
    reference = _epochs(_setup(_fabric()), 2)
    fabric = _fabric()
    loader = _setup(fabric)
    fabric.save(tmp_path / "before", {"loader": loader})  # before any iteration
    seen = []
    for index, batch in enumerate(loader):
        seen.append(batch.tolist())
        if index in (0, 5):  # mid-epoch, and after the last batch
            fabric.save(tmp_path / f"at{index}", {"loader": loader})
    fabric.save(tmp_path / "after", {"loader": loader})
    assert [seen, *_epochs(loader, 1)] == reference


@needs_torchdata
def test_epoch_boundary_state_starts_the_next_epoch(tmp_path: Path) -> None:
    reference = _epochs(_setup(_fabric()), 3)
    fabric = _fabric()
    loader = _setup(fabric)
    _epochs(loader, 1)
    fabric.save(tmp_path / "ckpt", {"loader": loader})
    resumed = _setup(_fabric(seed=1))
    _fabric().load(tmp_path / "ckpt", {"loader": resumed})
    assert _epochs(resumed, 2) == reference[1:]


@needs_torchdata
def test_sequential_loader_resumes(tmp_path: Path) -> None:
    fabric = _fabric()
    loader = _setup(fabric, shuffle=False)
    iterator = iter(loader)
    _take(iterator, 3)
    fabric.save(tmp_path / "ckpt", {"loader": loader})
    resumed = _setup(fabric, shuffle=False)
    fabric.load(tmp_path / "ckpt", {"loader": resumed})
    assert next(iter(resumed)).tolist() == [12, 13, 14, 15]


@needs_torchdata
def test_one_process_shuffles_exactly_as_plain_pytorch() -> None:
    # The same seed gives the same batches as a plain DataLoader (and so as Lightning Fabric), every epoch.
    torch.manual_seed(5)
    plain = DataLoader(_Counting(23), batch_size=4, shuffle=True)
    expected = [[batch.tolist() for batch in plain] for _ in range(3)]
    assert _epochs(_setup(_fabric()), 3) == expected


@needs_torchdata
@pytest.mark.parametrize("kind", ["weighted", "subset", "generator"])
def test_other_random_samplers_resume_and_keep_pytorchs_order(tmp_path: Path, kind: str) -> None:
    def sampler() -> Any:
        if kind == "weighted":
            return WeightedRandomSampler([1.0] * 23, num_samples=23)
        if kind == "subset":
            return SubsetRandomSampler(list(range(23)))
        return RandomSampler(range(23), generator=torch.Generator().manual_seed(3))

    def loader(fabric: Fabric) -> Any:
        return fabric.setup_dataloaders(DataLoader(_Counting(23), batch_size=4, sampler=sampler()))

    torch.manual_seed(5)
    plain = DataLoader(_Counting(23), batch_size=4, sampler=sampler())
    reference = [[batch.tolist() for batch in plain] for _ in range(2)]
    fabric = _fabric()
    first_run = loader(fabric)
    assert isinstance(first_run.dataloader.sampler, _ReplaySampler)
    iterator = iter(first_run)
    first = _take(iterator, 3)
    fabric.save(tmp_path / "ckpt", {"loader": first_run})
    resumed = loader(_fabric(seed=11))
    fabric.load(tmp_path / "ckpt", {"loader": resumed})
    assert first + [batch.tolist() for batch in resumed] == reference[0]
    assert _epochs(resumed, 1) == reference[1:]


@needs_torchdata
def test_saving_adds_each_ranks_state_under_its_rank(tmp_path: Path) -> None:
    fabric = _fabric()
    loader = _setup(fabric)
    iterator = iter(loader)
    _take(iterator, 2)
    fabric.save(tmp_path / "ckpt", {"loader": loader})
    saved = torch.load(tmp_path / "ckpt", weights_only=True)["loader"]
    assert saved[_loader_state.MARKER] == 1 and saved["world_size"] == 1 and list(saved["ranks"]) == ["0"]
    state = saved["ranks"]["0"]
    assert state["epoch"] == 0 and state["mid_epoch"] and state["batches"] == 2
    assert state["fingerprint"] == {
        "dataset_length": 23,
        "batch_size": 4,
        "drop_last": False,
        "order": "shuffled",
        "seed": None,
    }


# -- bad inputs ------------------------------------------------------------------------------------------------
def _saved_mid_epoch(tmp_path: Path, **kwargs: Any) -> Path:
    fabric = _fabric()
    loader = _setup(fabric, **kwargs)
    iterator = iter(loader)
    _take(iterator, 2)
    fabric.save(tmp_path / "ckpt", {"loader": loader})
    return tmp_path / "ckpt"


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        ({"n": 24}, "dataset_length: saved 23, now 24"),
        ({"batch_size": 5}, "batch_size: saved 4, now 5"),
        ({"shuffle": False}, "order: saved 'shuffled', now 'sequential'"),
        ({"drop_last": True}, "drop_last: saved False, now True"),
    ],
)
@needs_torchdata
def test_state_of_another_loader_is_refused(tmp_path: Path, changed: dict[str, Any], message: str) -> None:
    path = _saved_mid_epoch(tmp_path)
    fabric = _fabric()
    other = _setup(fabric, **changed)
    with pytest.raises(ValueError, match=r"the saved loader state belongs to a loader that differs from this") as err:
        fabric.load(path, {"loader": other})
    assert message in str(err.value)
    assert "or leave the loader out of the state given to fabric.load to start its epoch from the beginning" in str(
        err.value
    )


def test_plain_dataloader_in_the_saved_state_is_refused(tmp_path: Path) -> None:
    fabric = _fabric()
    with pytest.raises(TypeError, match=r"save\(state\['loader'\]=DataLoader\): this DataLoader was not set up"):
        fabric.save(tmp_path / "ckpt", {"loader": DataLoader(_Counting(4))})
    assert not (tmp_path / "ckpt").exists()


@needs_torchdata
def test_loader_state_loaded_into_a_plain_dataloader_is_refused(tmp_path: Path) -> None:
    path = _saved_mid_epoch(tmp_path)
    state = {"loader": DataLoader(_Counting(23), batch_size=4)}
    with pytest.raises(TypeError, match=r"load\(state\['loader'\]=DataLoader\): this DataLoader was not set up by"):
        _fabric().load(path, state)
    assert isinstance(state["loader"], DataLoader), "the user's object was not replaced"


@needs_torchdata
def test_other_entry_loaded_into_a_loader_is_refused(tmp_path: Path) -> None:
    fabric = _fabric()
    fabric.save(tmp_path / "ckpt", {"loader": {"position": 3}})
    with pytest.raises(ValueError, match=r"the checkpoint entry \(dict\) is not a loader state saved by fabric"):
        fabric.load(tmp_path / "ckpt", {"loader": _setup(fabric)})


def test_state_of_one_rank_only_is_refused() -> None:
    saved = _loader_state.entry({"0": {}}, world_size=2)
    with pytest.raises(ValueError, match=r"holds ranks \['0'\] only, not rank 1"):
        _loader_state.rank_state(saved, rank=1, world_size=2)


def test_mid_epoch_state_on_another_world_size_is_refused() -> None:
    mid = {"mid_epoch": True, "epoch": 2, "batches": 3}
    saved = _loader_state.entry({"0": mid, "1": mid}, world_size=2)
    with pytest.raises(ValueError, match=r"saved by 2 ranks in the middle of epoch 2 \(after 3 batches\), and this"):
        _loader_state.rank_state(saved, rank=0, world_size=1)


class _OwnStateLoader(DataLoader):
    """A DataLoader subclass with a state of its own, as litdata's StreamingDataLoader has."""

    def state_dict(self) -> dict[str, Any]:
        return {"own": 7}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loaded = state


@needs_torchdata
def test_dataloader_subclass_is_kept_and_saved_whole_with_a_warning(tmp_path: Path) -> None:
    # Lightning Fabric pickles such a loader; fabric does the same and says that the position is not saved.
    fabric = _fabric()
    loader = fabric.setup_dataloaders(_MyLoader(_Counting(8), batch_size=2))
    assert type(loader.dataloader) is _MyLoader
    with pytest.warns(UserWarning, match=r"this DataLoader subclass \(_MyLoader\) has no state_dict of its own, so"):
        fabric.save(tmp_path / "ckpt", {"loader": loader})
    assert type(torch.load(tmp_path / "ckpt", weights_only=False)["loader"]) is _MyLoader


@needs_torchdata
def test_dataloader_subclass_with_its_own_state_saves_and_loads_it(tmp_path: Path) -> None:
    fabric = _fabric()
    loader = fabric.setup_dataloaders(_OwnStateLoader(_Counting(8), batch_size=2))
    plain = _OwnStateLoader(_Counting(8), batch_size=2)  # not set up: Lightning saves its state all the same
    fabric.save(tmp_path / "ckpt", {"loader": loader, "plain": plain})
    assert torch.load(tmp_path / "ckpt") == {"loader": {"own": 7}, "plain": {"own": 7}}
    fabric.load(tmp_path / "ckpt", {"loader": loader, "plain": plain})
    assert loader.dataloader.loaded == plain.loaded == {"own": 7}


def test_without_torchdata_a_loader_is_saved_as_lightning_does(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_loader_state, "stateful_loader_class", lambda: None)
    fabric = _fabric()
    loader = _setup(fabric)
    assert type(loader.dataloader) is DataLoader, "the loader works as before"
    assert len(list(loader)) == 6
    message = r"torchdata is not installed, so the loader's position in its epoch is not saved and a resumed run"
    with pytest.warns(UserWarning, match=message):
        fabric.save(tmp_path / "ckpt", {"loader": loader, "step": 3})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per loader
        fabric.save(tmp_path / "ckpt", {"loader": loader, "step": 3})
    assert type(torch.load(tmp_path / "ckpt", weights_only=False)["loader"]) is DataLoader
    state = {"loader": loader, "step": 0}
    fabric.load(tmp_path / "ckpt", state, weights_only=False)
    assert state == {"loader": loader, "step": 3}, "the set-up loader stays; it starts its next epoch afresh"
    assert len(list(loader)) == 6
    # A saved position cannot be ignored: the resumed run would read the wrong batches.
    with pytest.raises(TypeError, match=r"load\(state with a loader from setup_dataloaders\): the loader's position "):
        loader.load_state_dict(_loader_state.entry({"0": {}}, world_size=1))
    with pytest.raises(TypeError, match=r"torchdata is not installed. Install it: pip install torchdata"):
        loader.state_dict()


@needs_torchdata
def test_model_optimizer_and_loader_resume_together(tmp_path: Path) -> None:
    def run(stop: int | None, path: Path, resume: bool) -> dict[str, torch.Tensor]:
        fabric = _fabric()
        model = nn.Linear(1, 1)
        model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
        loader = _setup(fabric)
        state = {"model": model, "optimizer": optimizer, "loader": loader, "step": 0}
        if resume:
            fabric.load(path, state)
        for _ in range(2):
            for batch in loader:
                loss = model(batch.float()[:, None]).pow(2).mean() * 1e-3
                fabric.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                state["step"] += 1
                if state["step"] == stop:
                    fabric.save(path, state)
                    return {}
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    full = run(None, tmp_path / "unused", resume=False)
    run(4, tmp_path / "ckpt", resume=False)
    resumed = run(None, tmp_path / "ckpt", resume=True)
    assert all(torch.equal(full[key], resumed[key]) for key in full)


def _gather_worker(rank: int, port: int, outdir: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=2, rank=rank)
    try:
        small = _loader_state._all_gather_small({"rank": rank})
        big = _loader_state._all_gather_small({"rank": rank, "blob": bytes([rank]) * (20000 + 5000 * rank)})
        torch.save({"small": small, "big": big}, Path(outdir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_gathering_rank_states_takes_a_second_round_only_for_large_states(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    from fabric.environments.default import find_free_port

    mp.start_processes(_gather_worker, args=(find_free_port(), str(tmp_path)), nprocs=2, start_method="fork")
    for rank in (0, 1):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert result["small"] == [{"rank": 0}, {"rank": 1}]
        assert [item["rank"] for item in result["big"]] == [0, 1]
        assert [item["blob"] for item in result["big"]] == [b"\x00" * 20000, b"\x01" * 25000]


def test_torchdata_comes_with_the_default_install() -> None:
    # Exact mid-epoch resume after `pip install torchfabric` alone; the former extra still installs.
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())["project"]
    assert "torchdata>=0.11" in project["dependencies"]
    assert project["optional-dependencies"]["resume"] == ["torchdata>=0.11"]
