"""The helpers Lightning Fabric code imports from `lightning.fabric.utilities`, under `fabric.utilities`."""

from __future__ import annotations

import logging
import os
import pickle
import random
from collections import namedtuple
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from fabric import Fabric
from fabric.accelerators import find_usable_cuda_devices
from fabric.utilities import (
    AttributeDict,
    LightningEnum,
    disable_possible_user_warnings,
    is_shared_filesystem,
    move_data_to_device,
    rank_zero_deprecation,
    rank_zero_info,
    rank_zero_only,
    rank_zero_warn,
    suggested_max_num_workers,
)
from fabric.utilities.apply_func import convert_tensors_to_scalars
from fabric.utilities.cloud_io import _load, get_filesystem
from fabric.utilities.data import has_len, sized_len
from fabric.utilities.device_parser import _determine_root_gpu_device, _parse_gpu_ids
from fabric.utilities.exceptions import FabricValueError, MisconfigurationException
from fabric.utilities.load import _lazy_load, _NotYetLoadedTensor
from fabric.utilities.rank_zero import (
    LightningDeprecationWarning,
    WarningCache,
    rank_prefixed_message,
    rank_zero_debug,
)
from fabric.utilities.seed import pl_worker_init_function, seed_everything
from fabric.utilities.warnings import PossibleUserWarning

# -- rank_zero ---------------------------------------------------------------------------------------


@pytest.fixture
def rank_one() -> Any:
    rank_zero_only.rank = 1
    yield
    rank_zero_only.rank = None


def test_rank_zero_helpers_emit_on_rank_zero(caplog: pytest.LogCaptureFixture) -> None:
    with pytest.warns(UserWarning, match="careful") as warned:
        rank_zero_warn("careful")
    with pytest.warns(LightningDeprecationWarning, match="old api") as deprecated:
        rank_zero_deprecation("old api")
    # like Lightning's, the default stacklevel names the line that called the helper
    assert Path(warned[0].filename).name == Path(deprecated[0].filename).name == "test_lightning_helpers.py"
    with caplog.at_level(logging.DEBUG, logger="fabric.utilities.rank_zero"):
        rank_zero_info("hello %s", "there")
        rank_zero_debug("details")
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [("INFO", "hello there"), ("DEBUG", "details")]
    assert caplog.records[0].filename == "test_lightning_helpers.py"  # stacklevel points at the caller


@pytest.mark.usefixtures("rank_one")
def test_rank_zero_helpers_are_silent_on_other_ranks(caplog: pytest.LogCaptureFixture) -> None:
    import warnings

    with warnings.catch_warnings(), caplog.at_level(logging.DEBUG):
        warnings.simplefilter("error")
        rank_zero_warn("careful")
        rank_zero_deprecation("old api")
        rank_zero_info("hello")
        rank_zero_debug("details")
    assert caplog.text == ""


def test_warning_cache_warns_once_per_message() -> None:
    cache = WarningCache()
    with pytest.warns(UserWarning) as record:
        cache.warn("a")
        cache.warn("a")
        cache.warn("b")
    assert [str(w.message) for w in record] == ["a", "b"]
    assert rank_prefixed_message("hi", 3) == "[rank: 3] hi" and rank_prefixed_message("hi", None) == "hi"


@pytest.mark.usefixtures("no_cluster_env")
def test_rank_is_read_from_torchrun_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert rank_zero_only.rank == 3
    assert rank_zero_only(lambda: "ran")() is None


@pytest.mark.usefixtures("no_cluster_env")
def test_the_rank_is_detected_again_only_when_the_environment_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    import types

    from fabric.utilities import rank_zero

    detections: list[int | None] = []
    real = rank_zero._rank_from_environment

    def counted() -> int | None:
        detections.append(real())
        return detections[-1]

    monkeypatch.setattr(rank_zero, "_rank_from_environment", counted)
    monkeypatch.setattr(rank_zero, "_environment_cache", None)
    assert [rank_zero_only.rank for _ in range(3)] == [0, 0, 0] and detections == [None], "one detection, then cached"
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert rank_zero_only.rank == 3 and rank_zero_only.rank == 3 and detections == [None, 3], "a new variable"
    monkeypatch.setenv("RANK", "2")
    assert rank_zero_only.rank == 2 and detections[-1] == 2, "a changed value is seen at the next read"
    monkeypatch.delenv("RANK")
    assert rank_zero_only.rank == 0, "torchrun's variables are incomplete again: a plain process"
    # In a process torch_xla's launcher started, its runtime's rank, asked every time (it is not an environment
    # variable): torch_xla imported after the last read, then another ordinal, with the environment unchanged.
    monkeypatch.setenv("PJRT_LOCAL_PROCESS_COUNT", "4")
    assert rank_zero_only.rank == 0
    runtime = types.SimpleNamespace(global_ordinal=lambda: 5)
    monkeypatch.setitem(sys.modules, "torch_xla", types.SimpleNamespace(runtime=runtime))
    assert rank_zero_only.rank == 5
    runtime.global_ordinal = lambda: 2
    assert rank_zero_only.rank == 2
    monkeypatch.delitem(sys.modules, "torch_xla")
    assert rank_zero_only.rank == 0 and len(detections) == 5, "the environment's answer, still cached"
    rank_zero_only.rank = 1
    assert rank_zero_only.rank == 1, "a rank set by the user wins over the cache"
    rank_zero_only.rank = None


# -- data --------------------------------------------------------------------------------------------


def test_attribute_dict_reads_writes_deletes_and_pickles() -> None:
    state = AttributeDict(step=0, model="m")
    state.step += 1
    state.lr = 0.1
    assert state == {"step": 1, "model": "m", "lr": 0.1} and state["lr"] == 0.1
    del state.lr
    assert "lr" not in state
    with pytest.raises(AttributeError, match="'AttributeDict' object has no attribute 'missing'"):
        _ = state.missing
    assert pickle.loads(pickle.dumps(state)) == state
    assert repr(AttributeDict(iter_num=1, model="Linear")) == '"iter_num": 1\n"model":    Linear'
    assert repr(AttributeDict()) == ""


def test_suggested_max_num_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    assert suggested_max_num_workers(1) == 15
    assert suggested_max_num_workers(4) == 3
    assert suggested_max_num_workers(32) == 1
    with pytest.raises(FabricValueError, match=r"local_world_size=0\): at least one process"):
        suggested_max_num_workers(0)


class _Stream(IterableDataset):
    def __iter__(self) -> Any:
        return iter(range(3))


class _SizedStream(_Stream):
    def __len__(self) -> int:
        return 3


def test_has_len_and_sized_len() -> None:
    assert has_len(DataLoader(list(range(4)))) and sized_len(DataLoader(list(range(4)))) == 4
    assert not has_len(DataLoader(_Stream())) and sized_len(DataLoader(_Stream())) is None
    with pytest.warns(UserWarning, match="has length 0"):
        assert has_len([])
    with pytest.warns(UserWarning, match="IterableDataset that defines __len__"):
        assert has_len(DataLoader(_SizedStream()))


# -- apply_func ----------------------------------------------------------------------------------------


@dataclass
class _Batch:
    x: torch.Tensor
    label: str


def test_move_data_to_device_and_convert_tensors_to_scalars() -> None:
    pair = namedtuple("pair", "a b")
    batch = {"t": torch.ones(2, dtype=torch.float64), "n": [pair(torch.zeros(1), 3)], "d": _Batch(torch.ones(1), "x")}
    moved = move_data_to_device(batch, "meta")
    assert moved["t"].device.type == "meta" and moved["n"][0].a.device.type == "meta" and moved["n"][0].b == 3
    assert moved["d"].x.device.type == "meta" and moved["d"].label == "x"
    assert convert_tensors_to_scalars({"loss": torch.tensor(1.5), "n": [torch.tensor(2)]}) == {"loss": 1.5, "n": [2]}
    with pytest.raises(ValueError, match=r"shape \(2,\) has 2 elements"):
        convert_tensors_to_scalars(torch.ones(2))


# -- cloud_io and load -----------------------------------------------------------------------------------


def test_get_filesystem_and_load_from_local_and_fsspec_urls(tmp_path: Path) -> None:
    from fsspec.implementations.local import LocalFileSystem
    from fsspec.implementations.memory import MemoryFileSystem

    assert isinstance(get_filesystem(tmp_path), LocalFileSystem)
    memory = get_filesystem("memory://ckpt/state.pt")
    assert isinstance(memory, MemoryFileSystem)
    with memory.open("memory://ckpt/state.pt", "wb") as handle:
        torch.save({"w": torch.arange(3)}, handle)
    torch.save({"w": torch.arange(4)}, tmp_path / "state.pt")
    assert torch.equal(_load("memory://ckpt/state.pt")["w"], torch.arange(3))
    assert torch.equal(_load(tmp_path / "state.pt", map_location="cpu")["w"], torch.arange(4))
    with (tmp_path / "state.pt").open("rb") as handle:
        assert torch.equal(_load(handle)["w"], torch.arange(4))


def test_lazy_load_memory_maps_the_tensors_and_loads_into_a_model(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    torch.save(model.state_dict(), tmp_path / "model.pt")
    state = _lazy_load(tmp_path / "model.pt")
    fresh = torch.nn.Linear(3, 2)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.weight, model.weight)
    # Real tensors, never Lightning's placeholder: code that checks for it (litgpt's converters) takes the tensor.
    assert all(type(t) is torch.Tensor and not isinstance(t, _NotYetLoadedTensor) for t in state.values())
    with pytest.raises(TypeError, match="never returns this placeholder"):
        _NotYetLoadedTensor()._load_tensor()
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(1)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(RuntimeError, match=r"legacy \(pre-1.6\) format, which cannot be memory-mapped"):
        _lazy_load(legacy)


# -- enums, warnings, seed -----------------------------------------------------------------------------


class _Mode(LightningEnum):
    TRAIN = "train"
    EVAL = "eval"


def test_lightning_enum_compares_to_strings_case_insensitively() -> None:
    assert _Mode.TRAIN == "train" and _Mode.TRAIN == "TRAIN" and _Mode.TRAIN != "eval"
    assert {_Mode.TRAIN: 1}["train"] == 1
    assert _Mode.from_str("EVAL") is _Mode.EVAL and _Mode.from_str("train", source="value") is _Mode.TRAIN
    assert str(_Mode.EVAL) == "eval"
    with pytest.raises(FabricValueError, match=r"_Mode.from_str\('test', source='key'\): no such member"):
        _Mode.from_str("test")


def test_disable_possible_user_warnings() -> None:
    import warnings

    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        disable_possible_user_warnings()
        warnings.warn("maybe wrong", PossibleUserWarning, stacklevel=1)
        warnings.warn("surely wrong", UserWarning, stacklevel=1)
    assert [str(w.message) for w in record] == ["surely wrong"]


def test_pl_worker_init_function_seeds_each_worker_differently_and_reproducibly() -> None:
    seed_everything(7, verbose=False)

    def draw(worker_id: int, rank: int) -> tuple[float, float]:
        torch.manual_seed(100)  # what the DataLoader sets in a worker before calling worker_init_fn
        pl_worker_init_function(worker_id, rank=rank)
        return random.random(), torch.rand(1).item()

    assert draw(0, 0) == draw(0, 0)
    assert len({draw(0, 0), draw(1, 0), draw(0, 1)}) == 3


# -- device parsing and usable GPUs ------------------------------------------------------------------------


def test_parse_gpu_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert _parse_gpu_ids(None, include_cuda=True) is None and _parse_gpu_ids(0, include_cuda=True) is None
    assert _parse_gpu_ids("0", include_cuda=True) is None and _parse_gpu_ids([], include_cuda=True) is None
    assert _parse_gpu_ids(2, include_cuda=True) == [0, 1]
    assert _parse_gpu_ids(-1, include_cuda=True) == [0, 1, 2, 3]
    assert _parse_gpu_ids("1,3", include_cuda=True) == [1, 3]
    with pytest.raises(MisconfigurationException, match=r"only 4 GPU device\(s\) exist here"):
        _parse_gpu_ids([5], include_cuda=True)
    with pytest.raises(FabricValueError, match="no GPU kind is included"):
        _parse_gpu_ids(1)
    assert _determine_root_gpu_device([2, 3]) == 2 and _determine_root_gpu_device(None) is None


def test_find_usable_cuda_devices_skips_gpus_that_refuse_allocations(monkeypatch: pytest.MonkeyPatch) -> None:
    real_tensor = torch.tensor

    def fake_tensor(data: Any, device: torch.device | None = None, **kwargs: Any) -> torch.Tensor:
        if device is not None and torch.device(device).index == 1:
            raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable")
        return real_tensor(data, **kwargs)

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch, "tensor", fake_tensor)
    assert find_usable_cuda_devices() == [0, 2]
    assert find_usable_cuda_devices(1) == [0]
    assert find_usable_cuda_devices(0) == []
    with pytest.raises(RuntimeError, match=r"only 2 of the 3 visible GPUs accept allocations \(\[0, 2\]\)"):
        find_usable_cuda_devices(3)
    with pytest.raises(ValueError, match=r"num_devices=4\): only 3 CUDA device\(s\) are visible"):
        find_usable_cuda_devices(4)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    with pytest.raises(ValueError, match="no CUDA device is visible"):
        find_usable_cuda_devices(1)


# -- shared file system ----------------------------------------------------------------------------------


def test_is_shared_filesystem_with_one_process_and_remote_urls(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu", devices=1)
    assert is_shared_filesystem(fabric.strategy, tmp_path)
    assert is_shared_filesystem(fabric.strategy, "s3://bucket/run")
    assert is_shared_filesystem(fabric.strategy)


def test_materialize_tensors_detaches_lazy_loaded_tensors_from_the_file(tmp_path: Path) -> None:
    from fabric.utilities.load import _materialize_tensors

    torch.save({"w": torch.arange(3.0)}, tmp_path / "w.pt")
    lazy = _lazy_load(tmp_path / "w.pt")
    loaded = _materialize_tensors(lazy)
    (tmp_path / "w.pt").unlink()
    assert torch.equal(loaded["w"], torch.arange(3.0))


def test_load_distributed_checkpoint_reads_a_sharded_directory_in_one_process(tmp_path: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    from fabric.utilities.load import _load_distributed_checkpoint

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        dcp.save({"model": {"w": torch.arange(4.0)}, "step": 3}, checkpoint_id=tmp_path / "ckpt")
    loaded = _load_distributed_checkpoint(tmp_path / "ckpt")
    assert loaded["step"] == 3 and torch.equal(loaded["model"]["w"], torch.arange(4.0))


# -- init and optimizer helpers ----------------------------------------------------------------------------


def test_meta_device_helpers_detect_and_materialize() -> None:
    from fabric.utilities.init import (
        _has_meta_device_parameters_or_buffers,
        _materialize,
        _materialize_distributed_module,
        _materialize_meta_tensors,
    )

    for materialize in (_materialize_meta_tensors, _materialize_distributed_module):
        with torch.device("meta"):
            model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.BatchNorm1d(4))
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        assert _has_meta_device_parameters_or_buffers(model) and _has_meta_device_parameters_or_buffers(optimizer)
        assert not _has_meta_device_parameters_or_buffers(model[1])
        materialize(model, "cpu")
        assert not _has_meta_device_parameters_or_buffers(model)
        assert torch.equal(model[2].running_var, torch.ones(4)) and model[0].weight.abs().sum() > 0

    class NoReset(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(2, device="meta"))

    with pytest.raises(TypeError, match=r"_materialize\(NoReset\): the module has no reset_parameters\(\)"):
        _materialize(NoReset(), "cpu")
    with pytest.raises(TypeError, match=r"expected a torch.nn.Module or a torch.optim.Optimizer"):
        _has_meta_device_parameters_or_buffers("model")


def test_optimizer_to_device_moves_state_but_not_step_counters() -> None:
    from fabric.utilities.optimizer import _optimizers_to_device

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    _optimizers_to_device([optimizer], "meta")
    state = optimizer.state[model.weight]
    assert state["exp_avg"].is_meta and state["exp_avg_sq"].is_meta
    assert state["step"].device.type == "cpu"


def test_set_sampler_epoch_reaches_the_sampler_once() -> None:
    from torch.utils.data import DistributedSampler

    from fabric.utilities.data import _set_sampler_epoch

    calls: list[int] = []

    class Counting(DistributedSampler):
        def set_epoch(self, epoch: int) -> None:
            calls.append(epoch)
            super().set_epoch(epoch)

    sampler = Counting(list(range(8)), num_replicas=2, rank=0)
    _set_sampler_epoch(DataLoader(list(range(8)), sampler=sampler, batch_size=2), 3)
    assert calls == [3] and sampler.epoch == 3
    _set_sampler_epoch(DataLoader(_Stream()), 1)  # no sampler to tell: nothing happens
