"""Sharded (torch.distributed.checkpoint) checkpoints in one process: round trips, atomic saves, bad input.

Two-process runs (FSDP2 shards, other world sizes) are in tests/integration/test_sharded_checkpoints.py.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from fabric import Fabric
from fabric.checkpoint import files as _sharded_files
from fabric.checkpoint import sharded as sc
from fabric.io import TorchCheckpointIO

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _model(seed: int = 0, out: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, out))


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = _model(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


def _save(path: Path, state: dict[str, Any], filter: Any = None) -> None:
    sc.save_sharded(path, state, filter, world_size=1, global_rank=0, barrier=lambda: None)


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.fixture
def saved(tmp_path: Path) -> tuple[Path, nn.Module, torch.optim.Optimizer]:
    model, optimizer = _trained()
    path = tmp_path / "ckpt"
    _save(path, {"model": model, "optimizer": optimizer, "step": 5, "config": {"name": "run", "sizes": [1, 2]}})
    return path, model, optimizer


# -- round trips ---------------------------------------------------------------------------------------
def test_round_trip_restores_module_optimizer_and_values(saved: tuple[Path, nn.Module, Any]) -> None:
    path, model, optimizer = saved
    assert sc.is_sharded_checkpoint(path)
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp"]
    fresh = _model(seed=1)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.5)
    state = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    remainder = sc.load(path, state, strict=True)
    assert _same(fresh, model)
    assert state["step"] == 5 and remainder == {"config": {"name": "run", "sizes": [1, 2]}}
    assert fresh_optimizer.param_groups[0]["lr"] == 0.01
    for key, value in optimizer.state_dict()["state"][0].items():
        assert torch.equal(fresh_optimizer.state_dict()["state"][0][key], value)


def test_objects_with_state_dict_and_fabric_wrappers(tmp_path: Path) -> None:
    fabric = Fabric(accelerator="cpu")
    model, optimizer = fabric.setup(*_trained())
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    _save(tmp_path / "ckpt", {"model": model, "optimizer": optimizer, "scheduler": scheduler})
    fresh, fresh_optimizer = fabric.setup(*_trained(seed=2))
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizer, step_size=7)
    sc.load(tmp_path / "ckpt", {"model": fresh, "optimizer": fresh_optimizer, "scheduler": fresh_scheduler}, True)
    assert _same(fresh, model)
    assert fresh_scheduler.state_dict() == scheduler.state_dict()


def test_state_none_returns_everything(saved: tuple[Path, nn.Module, Any]) -> None:
    path, model, _ = saved
    whole = sc.load(path, None, strict=True)
    assert set(whole) == {"model", "optimizer", "step", "config"}
    assert whole["model"].keys() == model.state_dict().keys()
    assert whole["step"] == 5


def test_filter_keeps_matching_entries(tmp_path: Path) -> None:
    model = _model()
    _save(tmp_path / "ckpt", {"model": model}, filter={"model": lambda key, _: key.startswith("2.")})
    assert set(sc.consolidate(tmp_path / "ckpt")["model"]) == {"2.weight", "2.bias"}


def test_load_raw_module_from_a_plain_state_dict_checkpoint(tmp_path: Path) -> None:
    model = _model()
    dcp.save(model.state_dict(), checkpoint_id=tmp_path / "raw", no_dist=True)
    fresh = _model(seed=3)
    assert sc.load(tmp_path / "raw", fresh, strict=True) == {}
    assert _same(fresh, model)
    with pytest.raises(TypeError, match="cannot be loaded without its module"):
        sc.load(tmp_path / "raw", torch.optim.SGD(fresh.parameters(), lr=0.1), strict=True)


def test_full_file_round_trip_and_plain_optimizer_state(tmp_path: Path) -> None:
    model, optimizer = _trained()
    sc.save_full(tmp_path / "full.pt", {"model": model, "optimizer": optimizer, "step": 2}, None,
                 TorchCheckpointIO(), is_global_zero=True)  # fmt: skip
    plain = _model(seed=4)
    plain.load_state_dict(torch.load(tmp_path / "full.pt")["model"])  # a plain file torch.load reads
    assert _same(plain, model)
    # A file from the plain strategies keeps optimizer state by position; load() accepts both layouts.
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "plain.pt")
    for name in ("full.pt", "plain.pt"):
        fresh = _model(seed=5)
        fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.3)
        sc.load(tmp_path / name, {"model": fresh, "optimizer": fresh_optimizer}, strict=True)
        assert _same(fresh, model)
        assert torch.equal(
            fresh_optimizer.state_dict()["state"][1]["exp_avg"], optimizer.state_dict()["state"][1]["exp_avg"]
        )
        assert fresh_optimizer.param_groups[0]["lr"] == 0.01


def test_plain_strategy_loads_a_sharded_directory(saved: tuple[Path, nn.Module, Any]) -> None:
    path, model, _ = saved
    fabric = Fabric(accelerator="cpu")
    fresh = fabric.setup_module(_model(seed=6))
    state = {"model": fresh, "step": 0}
    assert set(fabric.load(path, state)) == {"optimizer", "config"}
    assert _same(fresh, model) and state["step"] == 5


# -- strict ----------------------------------------------------------------------------------------------
def test_strict_missing_state_key(saved: tuple[Path, nn.Module, Any]) -> None:
    path = saved[0]
    with pytest.raises(KeyError, match=re.escape("the checkpoint has no entry for ['epoch']")):
        sc.load(path, {"model": _model(), "epoch": 0}, strict=True)
    state = {"model": _model(seed=7), "epoch": 0}
    sc.load(path, state, strict=False)
    assert state["epoch"] == 0


def test_strict_module_with_extra_parameters(saved: tuple[Path, nn.Module, Any]) -> None:
    path, model, _ = saved
    bigger = nn.Sequential(*_model(seed=8), nn.Linear(3, 2))
    with pytest.raises(RuntimeError, match=re.escape("does not match the object it is loaded into: missing ['3.bias'")):
        sc.load(path, {"model": bigger}, strict=True)
    sc.load(path, {"model": bigger}, strict=False)
    assert all(torch.equal(bigger.state_dict()[k], v) for k, v in model.state_dict().items())


def test_wrong_shape_names_key_saved_and_expected_shape(saved: tuple[Path, nn.Module, Any]) -> None:
    path = saved[0]
    target = _model(seed=9, out=5)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    expected = "'2.weight': saved [3, 8], expected [5, 8]; '2.bias': saved [3], expected [5]"
    with pytest.raises(RuntimeError, match=re.escape(expected)):
        sc.load(path, {"model": target}, strict=False)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items()), "nothing loaded"


# -- optimizer pairing -----------------------------------------------------------------------------------
def test_optimizer_without_its_module_is_an_error(tmp_path: Path) -> None:
    _, optimizer = _trained()
    with pytest.raises(ValueError, match="the optimizer's parameters belong to none of the modules in the state"):
        _save(tmp_path / "ckpt", {"optimizer": optimizer, "step": 1})
    assert not (tmp_path / "ckpt").exists() and not _sharded_files.staging_dir(tmp_path / "ckpt").exists()


def test_optimizer_spread_over_two_modules_is_an_error(tmp_path: Path) -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*a.parameters(), *b.parameters()], lr=0.1)
    with pytest.raises(ValueError, match=r"spread over the modules \['a', 'b'\]"):
        _save(tmp_path / "ckpt", {"a": a, "b": b, "optimizer": optimizer})


# -- atomic saves ----------------------------------------------------------------------------------------
def test_failed_save_leaves_previous_checkpoint(saved: tuple[Path, nn.Module, Any]) -> None:
    path, model, _ = saved
    before = _digest(path)
    with pytest.raises(RuntimeError, match=r"writing the sharded checkpoint failed .*pickle.*was not changed"):
        _save(path, {"model": _model(seed=10), "fn": lambda x: x})
    assert _digest(path) == before
    assert not _sharded_files.staging_dir(path).exists()
    fresh = _model(seed=11)
    sc.load(path, {"model": fresh}, strict=True)
    assert _same(fresh, model)


def test_new_save_replaces_old_and_clears_a_stale_staging_dir(saved: tuple[Path, nn.Module, Any]) -> None:
    path = saved[0]
    stale = _sharded_files.staging_dir(path)
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"left by a killed save")
    newer = _model(seed=12)
    _save(path, {"model": newer})
    assert not stale.exists() and not _sharded_files.backup_dir(path).exists()
    assert set(sc.load(path, None, strict=True)) == {"model"}


def test_swap_without_atomic_exchange(saved: tuple[Path, nn.Module, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    path = saved[0]
    monkeypatch.setattr(_sharded_files, "_exchange", lambda a, b: False)
    _save(path, {"step": 6})
    assert sc.load(path, None, strict=True) == {"step": 6}
    assert not _sharded_files.backup_dir(path).exists()


def test_interrupted_swap_points_at_the_backup(saved: tuple[Path, nn.Module, Any]) -> None:
    path = saved[0]
    path.rename(_sharded_files.backup_dir(path))
    with pytest.raises(FileNotFoundError, match=r"the previous complete checkpoint is at .*ckpt\.old"):
        sc.load(path, {"model": _model()}, strict=True)


def test_save_over_a_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("keep me")
    with pytest.raises(FileExistsError, match="a file exists at this path"):
        _save(tmp_path / "ckpt", {"model": _model()})
    assert (tmp_path / "ckpt").read_text() == "keep me"


# -- bad input ---------------------------------------------------------------------------------------------
def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no checkpoint exists at this path"):
        sc.load(tmp_path / "nope", None, strict=True)


def test_directory_that_is_not_a_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("hi")
    assert not sc.is_sharded_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=r"not a torch.distributed.checkpoint \(sharded\) checkpoint"):
        sc.load(tmp_path, None, strict=True)


def test_missing_metadata(saved: tuple[Path, nn.Module, Any]) -> None:
    path = saved[0]
    (path / ".metadata").unlink()
    assert sc.is_sharded_checkpoint(path)
    with pytest.raises(RuntimeError, match=r"incomplete: \.metadata is missing \(shard files present: __0_0.distcp"):
        sc.load(path, {"model": _model()}, strict=True)


def test_missing_shard_file(saved: tuple[Path, nn.Module, Any]) -> None:
    path = saved[0]
    (path / "__0_0.distcp").unlink()
    target = _model(seed=13)
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"incomplete: missing files: __0_0\.distcp"):
        sc.load(path, {"model": target}, strict=True)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())


def test_truncated_shard_file(saved: tuple[Path, nn.Module, Any]) -> None:
    path = saved[0]
    shard = path / "__0_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(RuntimeError, match=r"incomplete: truncated files: __0_0.distcp \(100 of \d+ bytes\)"):
        sc.load(path, None, strict=True)


def test_corrupt_metadata(saved: tuple[Path, nn.Module, Any]) -> None:
    path = saved[0]
    (path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(RuntimeError, match=r"\.metadata cannot be read .* truncated or corrupt"):
        sc.load(path, None, strict=True)


def test_consolidate_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"consolidate\(.*\): no checkpoint exists"):
        sc.consolidate(tmp_path / "nope")
    (tmp_path / "file.pt").write_bytes(b"")
    with pytest.raises(ValueError, match="this is a file; only a sharded checkpoint directory needs consolidating"):
        sc.consolidate(tmp_path / "file.pt")


@pytest.mark.parametrize("atomic_exchange", [True, False])
def test_a_250_character_directory_name_saves_twice_and_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, atomic_exchange: bool
) -> None:
    # The staging and backup siblings add '..saving' / '..old' to the name: they must still fit in 255 bytes.
    if not atomic_exchange:
        monkeypatch.setattr(_sharded_files, "_exchange", lambda a, b: False)
    path = tmp_path / ("c" * 250)
    model, optimizer = _trained()
    _save(path, {"model": model, "step": 1})
    _save(path, {"model": model, "optimizer": optimizer, "step": 2})  # the second save swaps with the first
    assert sc.load(path, None, strict=True)["step"] == 2
    assert [p.name for p in tmp_path.iterdir()] == [path.name]
