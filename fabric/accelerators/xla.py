"""XLA accelerator: TPUs (or any PJRT device, such as the CPU for tests) through torch_xla."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any

import torch

from fabric.accelerators._devices import _bad, _parse_str
from fabric.accelerators.accelerator import Accelerator
from fabric.utilities.exceptions import FabricValueError

# TPU chips show up on the PCI bus with Google's vendor id and one of these device ids (v2/v3, v4, v5e, v6e, 7x and
# test parts). Reading sysfs tells "is this a TPU host?" without importing torch_xla, which takes seconds.
_GOOGLE_PCI_VENDOR = "0x1ae0"
_TPU_PCI_DEVICES = frozenset({"0x0027", "0x005e", "0x0063", "0x006f", "0x0056", "0x0062", "0x0076"})
# PJRT device kinds other than the TPU say how many devices they expose through these variables (torch_xla reads
# the same ones); without one, a PJRT client exposes one device.
_COUNT_VARIABLES = {"CPU": "CPU_NUM_DEVICES", "CUDA": "GPU_NUM_DEVICES", "GPU": "GPU_NUM_DEVICES"}


def xla_installed() -> bool:
    """Whether torch_xla can be imported (without importing it)."""
    if "torch_xla" in sys.modules:
        return sys.modules["torch_xla"] is not None
    try:
        return importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):
        return False


def pjrt_device() -> str | None:
    """The PJRT device kind this process asks for (`PJRT_DEVICE`, e.g. TPU or CPU), or TPU on a TPU host."""
    configured = os.environ.get("PJRT_DEVICE", "").strip()
    if configured:
        return configured.split("_")[0].upper()
    return "TPU" if _tpu_chip_count() > 0 else None


def on_tpu_host() -> bool:
    """Whether `accelerator='auto'` should pick XLA: torch_xla is installed and this host's PJRT device is a TPU."""
    return xla_installed() and pjrt_device() == "TPU"


def _tpu_chip_count() -> int:
    chips = 0
    for vendor_file in Path("/sys/bus/pci/devices").glob("*/vendor"):
        try:
            if vendor_file.read_text().strip() != _GOOGLE_PCI_VENDOR:
                continue
            device_id = (vendor_file.parent / "device").read_text().strip()
        except OSError:
            continue
        chips += device_id in _TPU_PCI_DEVICES
    return chips


def _tpu_device_count() -> int:
    # torch_xla knows how many devices a chip exposes (two on v2/v3, one later); it reads the TPU's metadata and does
    # not start the runtime, so xmp.spawn can still launch afterwards.
    from torch_xla._internal import tpu

    return int(tpu.num_available_devices())


def _count_from_env(kind: str) -> int:
    variable = _COUNT_VARIABLES.get(kind)
    text = os.environ.get(variable, "1") if variable else "1"
    try:
        return max(int(text), 0)
    except ValueError:
        raise FabricValueError(
            f"{variable}={text!r}: not a device count. Set it to a positive integer such as 4, or unset it."
        ) from None


class XLAAccelerator(Accelerator):
    """Devices of the PJRT runtime (TPU cores, or virtual CPU devices with `PJRT_DEVICE=CPU`)."""

    name = "xla"

    def __init__(self) -> None:
        if not xla_installed():
            raise ModuleNotFoundError(
                "Fabric(accelerator='xla'): torch_xla is not installed, so no XLA device can be used. Install it with "
                "`pip install torchfabric[xla]` (on a TPU VM: `pip install torch_xla[tpu]`), or use accelerator='auto'."
            )
        if pjrt_device() is None:
            raise RuntimeError(
                "Fabric(accelerator='xla'): no PJRT device is configured and this host has no TPU. Set PJRT_DEVICE "
                "(e.g. PJRT_DEVICE=CPU to run XLA on the CPU, CPU_NUM_DEVICES=4 for four virtual devices), "
                "or use accelerator='cpu'."
            )

    @staticmethod
    def is_available() -> bool:
        """torch_xla is installed and a PJRT device (configured, or a TPU on this host) has at least one device."""
        if not xla_installed() or pjrt_device() is None:
            return False
        try:
            return XLAAccelerator.auto_device_count() > 0
        except (OSError, ValueError, AssertionError):
            # torch_xla raises these when the TPU metadata cannot be read: then the TPU cannot be used either.
            return False

    @staticmethod
    def auto_device_count() -> int:
        """All devices of this host's PJRT runtime (0 without torch_xla or a PJRT device)."""
        if not xla_installed():
            return 0
        kind = pjrt_device()
        if kind is None:
            return 0
        if kind == "TPU":
            return _tpu_device_count()
        return _count_from_env(kind)

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        """1, all devices ('auto', -1 or their count), or one chosen device `[i]`: what torch_xla can launch."""
        available = XLAAccelerator.auto_device_count()
        if isinstance(devices, bool):
            raise _bad(devices, "a bool is not a device count", "Pass 1, 'auto', or one index such as [0].")
        passed = devices
        if isinstance(devices, str) and devices.strip() not in ("auto", "-1"):
            devices = _parse_str(devices)
        if devices in ("auto", -1, "-1") or (isinstance(devices, int) and devices == available > 0):
            if available < 1:
                raise _bad(passed, "no XLA device is available", "Check PJRT_DEVICE, or choose another accelerator.")
            return list(range(available))
        if devices == 1:
            return [0]
        if isinstance(devices, (list, tuple)) and len(devices) == 1 and type(devices[0]) is int:
            if 0 <= devices[0] < available:
                return [devices[0]]
            raise _bad(
                passed,
                f"XLA device {devices[0]} does not exist; this host has {available} (0 to {available - 1})",
                f"Pick an index from 0 to {available - 1}.",
            )
        raise _bad(
            passed,
            f"torch_xla runs either one device or all {available} devices of this host",
            f"Pass devices=1, devices={available} (or 'auto'), or one device such as [0].",
        )

    @staticmethod
    def get_parallel_devices(indices: list[int]) -> list[torch.device]:
        """One `xla:i` device per index (the real device of each process is known only after the launch)."""
        return [torch.device("xla", i) for i in indices]

    def setup_device(self, device: torch.device) -> None:
        """torch_xla binds each process to its device when it launches it; nothing is left to select."""
        if device.type != "xla":
            raise FabricValueError(f"XLAAccelerator.setup_device({device}): not an XLA device. Pass an 'xla:N' device.")
