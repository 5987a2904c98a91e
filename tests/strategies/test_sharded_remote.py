"""Sharded (DCP) checkpoint directories on fsspec URLs, in one process: memory:// and s3:// (a loopback moto server).

Two ranks saving to S3 are in tests/integration/test_sharded_remote.py.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.checkpoint import sharded as sc
from fabric.cli import main as cli_main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _trained(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).pow(2).mean().backward()
    optimizer.step()
    return model, optimizer


def _save(url: str, state: dict[str, Any]) -> None:
    sc.save_sharded(url, state, None, world_size=1, global_rank=0, barrier=lambda: None)


def _same(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


@pytest.fixture
def in_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def memory_url() -> Iterator[str]:
    import fsspec

    yield "memory://fabric-sharded/ckpt"
    fs = fsspec.filesystem("memory")
    if fs.exists("/fabric-sharded"):
        fs.rm("/fabric-sharded", recursive=True)


def _round_trip(url: str, tmp_path: Path) -> None:
    model, optimizer = _trained(0)
    _save(url, {"model": model, "optimizer": optimizer, "step": 5})
    assert sc.is_sharded_checkpoint(url)
    fresh, fresh_optimizer = _trained(1)
    state: dict[str, Any] = {"model": fresh, "optimizer": fresh_optimizer, "step": 0}
    assert Fabric(accelerator="cpu", devices=1).load(url, state) == {}
    assert _same(fresh, model) and state["step"] == 5
    assert fresh_optimizer.state_dict()["state"][0]["exp_avg"].equal(optimizer.state_dict()["state"][0]["exp_avg"])

    # Overwrite: the new checkpoint replaces the old one completely; no staging prefix is left.
    newer, newer_optimizer = _trained(2)
    _save(url, {"model": newer, "optimizer": newer_optimizer, "step": 6})
    assert sc.load(url, {"model": fresh}, strict=False)["step"] == 6
    assert _same(fresh, newer)

    # A save that fails midway (an object that cannot be pickled) leaves the previous checkpoint loadable.
    with pytest.raises(RuntimeError, match=r"writing the sharded checkpoint failed"):
        _save(url, {"model": model, "bad": lambda: None})
    assert sc.load(url, None, strict=True)["step"] == 6

    output = tmp_path / "whole.pt"
    assert cli_main(["consolidate", url, str(output)]) == 0
    whole = torch.load(output)
    assert whole["step"] == 6 and torch.equal(whole["model"]["0.weight"], newer.state_dict()["0.weight"])
    # The output may be a URL as well; an existing one is refused without --force.
    remote_output = f"{url}-whole.pt"
    assert cli_main(["consolidate", url, remote_output]) == 0
    assert Fabric(accelerator="cpu", devices=1).load(remote_output)["step"] == 6
    assert cli_main(["consolidate", url, remote_output]) == 2
    assert cli_main(["consolidate", url, remote_output, "--force"]) == 0


def test_sharded_round_trip_on_memory_url(in_tmp: Path, memory_url: str) -> None:
    import fsspec

    _round_trip(memory_url, in_tmp)
    fs = fsspec.filesystem("memory")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls("/fabric-sharded", detail=False)) == ["ckpt", "ckpt-whole.pt"]
    assert sorted(p.name for p in in_tmp.iterdir()) == ["whole.pt"]


def test_sharded_round_trip_on_s3(in_tmp: Path, s3_bucket: str) -> None:
    _round_trip(f"{s3_bucket}/run/ckpt", in_tmp)
    assert sorted(p.name for p in in_tmp.iterdir()) == ["whole.pt"]


def test_a_malicious_remote_sharded_checkpoint_is_refused(in_tmp: Path, memory_url: str) -> None:
    import fsspec

    model, _ = _trained(0)
    _save(memory_url, {"model": model, "step": 1})
    fs = fsspec.filesystem("memory")

    class Payload:
        def __reduce__(self) -> tuple[Any, ...]:
            return (eval, ("1",))

    fs.pipe_file("/fabric-sharded/ckpt/.metadata", pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match=r"refused to load the checkpoint for safety"):
        Fabric(accelerator="cpu", devices=1).load(memory_url)


def test_missing_remote_shard_is_named(in_tmp: Path, memory_url: str) -> None:
    import fsspec

    model, _ = _trained(0)
    _save(memory_url, {"model": model})
    fs = fsspec.filesystem("memory")
    shard = next(p for p in fs.ls("/fabric-sharded/ckpt", detail=False) if p.endswith(".distcp"))
    fs.rm(shard)
    with pytest.raises(RuntimeError, match=r"the checkpoint is incomplete: missing files: __0_0.distcp"):
        sc.load(memory_url, {"model": model}, strict=True)


def test_a_half_published_checkpoint_points_at_the_staged_one(in_tmp: Path, memory_url: str) -> None:
    import fsspec

    from fabric.checkpoint import remote as _sharded_remote

    model, _ = _trained(0)
    _save(memory_url, {"model": model})
    fs = fsspec.filesystem("memory")
    # What a process killed while publishing leaves: shards at the path, no .metadata; the staged copy complete.
    fs.copy("/fabric-sharded/ckpt", "/fabric-sharded/.ckpt.saving", recursive=True)
    fs.rm("/fabric-sharded/ckpt/.metadata")
    with pytest.raises(RuntimeError, match=r"incomplete: .metadata is missing.*complete new checkpoint is at"):
        sc.load(memory_url, {"model": model}, strict=True)
    assert _sharded_remote.staging_url(memory_url) == "memory://fabric-sharded/.ckpt.saving"
