"""Plain tensors come back on the device they were saved from (issue 14), not forced onto CPU.

No GPU here, so the checkpoints are written with the device tag a GPU save writes: torch.save records each storage's
device through torch.serialization.location_tag, and patching it yields byte-for-byte the file a save from that
device produces ('meta' exists on every machine, so it shows the tensor really is placed back; 'cuda:0' does not
exist here, so it shows the CPU fallback).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric, TorchCheckpointIO
from fabric.io._load import DeviceRecorder


def _save_tagged(monkeypatch: pytest.MonkeyPatch, path: Path, state: dict[str, Any], tag: str) -> None:
    original = torch.serialization.location_tag
    with monkeypatch.context() as patch:
        patch.setattr(
            torch.serialization, "location_tag", lambda storage: tag if storage.nbytes() == 64 else original(storage)
        )
        Fabric(accelerator="cpu", devices=1).save(path, state)


def test_a_plain_tensor_keeps_its_saved_device(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "ema.ckpt"
    model = nn.Linear(2, 2)
    ema = torch.arange(16.0)  # 64 bytes: the one storage tagged 'meta'
    _save_tagged(monkeypatch, path, {"model": model, "ema": ema, "nested": {"buffers": [ema]}}, "meta")
    fabric = Fabric(accelerator="cpu", devices=1)
    target = nn.Linear(2, 2)
    remainder = fabric.load(path, {"model": target})
    assert remainder["ema"].device.type == "meta"
    assert remainder["nested"]["buffers"][0].device.type == "meta"
    # A module loads through load_state_dict into its own device (CPU here), whatever the saved tags say.
    assert target.weight.device.type == "cpu"
    assert torch.equal(target.weight, model.weight)
    assert TorchCheckpointIO().load_checkpoint(path)["ema"].device.type == "meta"
    # Asked for explicitly, map_location still wins.
    assert TorchCheckpointIO().load_checkpoint(path, map_location="cpu")["ema"].device.type == "cpu"


def test_a_tensor_from_a_device_that_is_absent_loads_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "gpu.ckpt"
    _save_tagged(monkeypatch, path, {"ema": torch.arange(16.0)}, "cuda:0")
    assert not torch.cuda.is_available()
    loaded = Fabric(accelerator="cpu", devices=1).load(path)
    assert loaded["ema"].device.type == "cpu"
    assert torch.equal(loaded["ema"], torch.arange(16.0))
    assert TorchCheckpointIO().load_checkpoint(path)["ema"].device.type == "cpu"


def test_each_process_takes_its_own_device_of_the_saved_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    # Rank 0 saved from cuda:0; rank 1's root device is cuda:1, so its plain tensors belong there, not on GPU 0.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    recorder = DeviceRecorder(torch.device("cuda", 1))
    storage = torch.arange(4.0).untyped_storage()
    recorder(storage, "cuda:0")
    tensor = torch.empty(0).set_(storage)
    assert recorder.target(tensor) == torch.device("cuda", 1)
    assert DeviceRecorder(torch.device("cpu")).target(torch.arange(3.0)) is None  # saved on CPU: stays
