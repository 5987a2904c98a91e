"""XLAAccelerator: availability, device counts and `devices` parsing, with torch_xla faked (runs without it)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from fabric import Fabric
from fabric.accelerators import ACCELERATOR_REGISTRY, XLAAccelerator
from fabric.accelerators import xla as xla_module


@pytest.fixture
def fake_xla(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A torch_xla that imports, on a host whose TPU has `tpu.devices` devices (4 unless a test changes it)."""
    state = types.SimpleNamespace(devices=4)
    torch_xla = types.ModuleType("torch_xla")
    internal = types.ModuleType("torch_xla._internal")
    tpu = types.ModuleType("torch_xla._internal.tpu")
    tpu.num_available_devices = lambda: state.devices  # type: ignore[attr-defined]
    internal.tpu = tpu  # type: ignore[attr-defined]
    torch_xla._internal = internal  # type: ignore[attr-defined]
    for name, module in (("torch_xla", torch_xla), ("torch_xla._internal", internal), ("torch_xla._internal.tpu", tpu)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    monkeypatch.delenv("CPU_NUM_DEVICES", raising=False)
    monkeypatch.setattr(xla_module, "_tpu_chip_count", lambda: 0)
    return state


def test_registered_as_xla_and_tpu() -> None:
    assert ACCELERATOR_REGISTRY.factory_of("xla") is XLAAccelerator
    assert ACCELERATOR_REGISTRY.factory_of("tpu") is XLAAccelerator


def test_missing_torch_xla_is_unavailable_and_explained(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_xla", None)
    assert not XLAAccelerator.is_available()
    assert XLAAccelerator.auto_device_count() == 0
    with pytest.raises(ModuleNotFoundError, match=r"torch_xla is not installed.*pip install torchfabric\[xla\]"):
        Fabric(accelerator="tpu")


def test_no_pjrt_device_and_no_tpu_is_explained(fake_xla: types.SimpleNamespace) -> None:
    assert not XLAAccelerator.is_available()
    with pytest.raises(RuntimeError, match=r"no PJRT device is configured.*Set PJRT_DEVICE"):
        Fabric(accelerator="xla")


def test_tpu_host_counts_torch_xla_devices(fake_xla: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xla_module, "_tpu_chip_count", lambda: 4)  # TPU chips on the PCI bus, PJRT_DEVICE unset
    assert xla_module.pjrt_device() == "TPU"
    assert xla_module.on_tpu_host()
    assert XLAAccelerator.is_available()
    assert XLAAccelerator.auto_device_count() == 4


def test_cpu_pjrt_counts_cpu_num_devices_and_is_not_a_tpu_host(
    fake_xla: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert XLAAccelerator.auto_device_count() == 1
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    assert XLAAccelerator.auto_device_count() == 4
    assert XLAAccelerator.is_available()
    assert not xla_module.on_tpu_host()


def test_bad_device_count_variable(fake_xla: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "four")
    with pytest.raises(ValueError, match=r"CPU_NUM_DEVICES='four': not a device count"):
        XLAAccelerator.auto_device_count()


def test_unreadable_tpu_metadata_means_unavailable(
    fake_xla: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_metadata() -> int:
        raise OSError("Failed to get TPU metadata")

    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    monkeypatch.setattr(sys.modules["torch_xla._internal.tpu"], "num_available_devices", no_metadata)
    assert not XLAAccelerator.is_available()


@pytest.mark.parametrize(
    ("devices", "expected"),
    [("auto", [0, 1, 2, 3]), (-1, [0, 1, 2, 3]), (4, [0, 1, 2, 3]), ("4", [0, 1, 2, 3]), (1, [0]), ("1", [0]),
     ([2], [2]), ("2,", [2]), ((3,), [3])],
)  # fmt: skip
def test_parse_devices_as_lightning(fake_xla: types.SimpleNamespace, devices: object, expected: list[int]) -> None:
    fake_xla.devices = 4
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PJRT_DEVICE", "TPU")
        assert XLAAccelerator.parse_devices(devices) == expected


@pytest.mark.parametrize(
    ("devices", "match"),
    [(2, r"runs either one device or all 4 devices.*devices=1, devices=4"),
     ([0, 1], r"runs either one device or all 4"),
     ([4], r"XLA device 4 does not exist; this host has 4 \(0 to 3\)"),
     (True, r"a bool is not a device count"),
     ("two", r"not a number")],
)  # fmt: skip
def test_parse_devices_rejects_what_torch_xla_cannot_launch(
    fake_xla: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch, devices: object, match: str
) -> None:
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    with pytest.raises(ValueError, match=match):
        XLAAccelerator.parse_devices(devices)


def test_parallel_devices_and_setup(fake_xla: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    accelerator = XLAAccelerator()
    assert accelerator.get_parallel_devices([0, 1]) == [torch.device("xla", 0), torch.device("xla", 1)]
    accelerator.setup_device(torch.device("xla", 1))
    with pytest.raises(ValueError, match=r"setup_device\(cpu\): not an XLA device"):
        accelerator.setup_device(torch.device("cpu"))


def test_auto_picks_xla_only_on_a_tpu_host(fake_xla: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric._connector import _auto_accelerator

    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # torch_xla on the CPU (a test machine): auto stays on the CPU
    assert not isinstance(_auto_accelerator(), XLAAccelerator)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    assert isinstance(_auto_accelerator(), XLAAccelerator)
