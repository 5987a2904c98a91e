"""Merging xla_fsdp shards written by several processes, with torch alone (no torch_xla), in the layout torch_xla's
XlaFullyShardedDataParallel gives its state dict and shard metadata. One-process shards of a real run are checked
in test_xla_cpu_pjrt.py; several processes cannot run on a CPU, so their shards are built here."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.strategies.xla import consolidate_xla_fsdp_checkpoint

WORLD = 3
SEP = "_FSDP_SHARD_SEPARATOR_"


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    model[1].running_mean.uniform_()
    return model


def _split(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Flatten, pad to equal parts, one part per rank (as the wrapper shards a parameter)."""
    flat = tensor.detach().flatten()
    per_rank = math.ceil(flat.numel() / WORLD)
    padded = torch.cat([flat, flat.new_zeros(per_rank * WORLD - flat.numel())])
    return list(padded.split(per_rank))


def _write(directory: Path, shards: list[dict], metadata: dict, module_key: str | None = "net") -> None:
    directory.mkdir()
    for rank, shard in enumerate(shards):
        optimizer = {"state": {0: {"momentum_buffer": torch.ones(2)}}, "param_groups": [{"params": [0]}]}
        entry = {module_key or "model": shard, "shard_metadata": {**metadata, "rank": rank}, "step": 5,
                 "optimizer": optimizer}  # fmt: skip
        torch.save(entry, directory / f"checkpoint_rank-{rank:08d}-of-{WORLD:08d}.pth")
    if module_key is not None:
        (directory / "xla_fsdp.json").write_text(json.dumps({"module_key": module_key, "world_size": WORLD}))


def _per_parameter_shards(model: nn.Module) -> tuple[list[dict], dict]:
    shards: list[dict] = [{} for _ in range(WORLD)]
    info = {}
    for name, param in model.named_parameters():
        wrapped = f"_fsdp_wrapped_module._fpw_module.{name}"
        shard_name = "_fsdp_shard" + SEP + SEP.join(wrapped.split("."))
        info[shard_name] = {"_orig_size": param.shape, "_orig_name": wrapped}
        for rank, part in enumerate(_split(param)):
            shards[rank][shard_name] = part
    for name, buffer in model.named_buffers():
        for shard in shards:
            shard[f"_fsdp_wrapped_module._fpw_module.{name}"] = buffer.clone()
    return shards, {"shard_info": {"": info}, "flatten_info": {}, "buffer_info": {}, "world_size": WORLD}


def test_per_parameter_shards_of_three_processes_merge_into_the_model(tmp_path: Path) -> None:
    model = _model()
    shards, metadata = _per_parameter_shards(model)
    _write(tmp_path / "ckpt", shards, metadata)
    merged = consolidate_xla_fsdp_checkpoint(tmp_path / "ckpt", tmp_path / "full.pt")
    assert sorted(merged) == ["net", "step"]  # the sharded optimizer state is left out
    expected = model.state_dict()
    assert merged["net"].keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(merged["net"][key], value), key
    fresh = nn.Sequential(nn.Linear(3, 5), nn.BatchNorm1d(5), nn.Linear(5, 2))
    state = {"net": fresh, "step": 0}
    Fabric(accelerator="cpu").load(tmp_path / "full.pt", state)
    assert state["step"] == 5
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), expected.values(), strict=True))


def test_flattened_parameters_are_split_back(tmp_path: Path) -> None:
    model = _model()
    params = dict(model.named_parameters())
    flat = torch.cat([p.detach().flatten() for p in params.values()])
    shard_name = "_fsdp_shard" + SEP + "_fsdp_wrapped_module" + SEP + "flat_param_0"
    metadata = {
        "shard_info": {"": {shard_name: {"_orig_size": flat.shape, "_orig_name": "_fsdp_wrapped_module.flat_param_0"}}},
        "flatten_info": {"_fsdp_wrapped_module.flat_param_0": (
            list(params), [p.shape for p in params.values()], [p.numel() for p in params.values()])},
        "buffer_info": {"_fsdp_wrapped_module.1.num_batches_tracked": {"_orig_dtype": torch.int64}},
        "world_size": WORLD,
    }  # fmt: skip
    shards = [{shard_name: part} for part in _split(flat)]
    for shard in shards:
        for name, buffer in model.named_buffers():
            # The wrapper may hold buffers in another dtype; the metadata gives the original one back.
            shard[f"_fsdp_wrapped_module.{name}"] = buffer.float() if name.endswith("tracked") else buffer
    _write(tmp_path / "flat", shards, metadata, module_key=None)  # as Lightning writes it: no json, key "model"
    merged = consolidate_xla_fsdp_checkpoint(tmp_path / "flat")["model"]
    for key, value in model.state_dict().items():
        assert torch.equal(merged[key], value) and merged[key].dtype == value.dtype, key


def test_missing_shards_are_named(tmp_path: Path) -> None:
    model = _model()
    shards, metadata = _per_parameter_shards(model)
    _write(tmp_path / "ckpt", shards, metadata)
    (tmp_path / "ckpt" / f"checkpoint_rank-00000001-of-{WORLD:08d}.pth").unlink()
    with pytest.raises(FileNotFoundError, match=r"written by 3 processes, but the shards \['checkpoint_rank-00000001"):
        consolidate_xla_fsdp_checkpoint(tmp_path / "ckpt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no 'checkpoint_rank-\*-of-\*.pth' shard files are in this directory"):
        consolidate_xla_fsdp_checkpoint(tmp_path / "empty")


def test_other_strategies_explain_how_to_read_shards(tmp_path: Path) -> None:
    shards, metadata = _per_parameter_shards(_model())
    _write(tmp_path / "ckpt", shards, metadata)
    with pytest.raises(ValueError, match=r"sharded xla_fsdp checkpoint.*consolidate_xla_fsdp_checkpoint\(path"):
        Fabric(accelerator="cpu").load(tmp_path / "ckpt", {"net": _model()})
