"""Tests for the accelerators: availability, parsing of the devices flag, and device setup."""

from __future__ import annotations

import os
import re
from typing import Any

import pytest
import torch

from fabric import CPUAccelerator, CUDAAccelerator, Fabric, MPSAccelerator
from fabric.accelerators._devices import parse_device_indices


# -- CPU -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("devices", "expected"),
    [("auto", [0]), (1, [0]), (3, [0, 1, 2]), ("3", [0, 1, 2]), (" 2 ", [0, 1])],
)
def test_cpu_parse_devices(devices: Any, expected: list[int]) -> None:
    assert CPUAccelerator.parse_devices(devices) == expected


@pytest.mark.parametrize("devices", [-1, "-1"])
def test_cpu_minus_one_means_one_process_per_core(devices: Any) -> None:
    assert CPUAccelerator.parse_devices(devices) == list(range(os.cpu_count() or 1))


@pytest.mark.parametrize(
    ("devices", "why"),
    [
        (0, "the number of CPU processes must be positive. Pass 1 or more, or -1 for one per core."),
        (-3, "the number of CPU processes must be positive"),
        (False, "on the CPU, devices is the number of processes"),
        ([0], "on the CPU, devices is the number of processes. Pass a positive int such as 2"),
        ("0,1", "on the CPU, devices is the number of processes"),
        (None, "on the CPU, devices is the number of processes"),
    ],
)
def test_cpu_parse_devices_errors(devices: Any, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"Fabric(devices={devices!r}): {why}")):
        CPUAccelerator.parse_devices(devices)


def test_cpu_accelerator_basics() -> None:
    accelerator = CPUAccelerator()
    assert CPUAccelerator.is_available()
    assert CPUAccelerator.auto_device_count() == 1
    assert CPUAccelerator.get_parallel_devices([0, 1]) == [torch.device("cpu"), torch.device("cpu")]
    accelerator.setup_device(torch.device("cpu"))  # nothing to do, and no error
    accelerator.teardown()


def test_cpu_setup_device_rejects_other_devices() -> None:
    with pytest.raises(ValueError, match=r"CPUAccelerator.setup_device\(cuda:0\): not a CPU device"):
        CPUAccelerator().setup_device(torch.device("cuda", 0))


# -- device indices (GPUs) ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("devices", "expected"),
    [
        (1, [0]),
        (4, [0, 1, 2, 3]),
        ([1, 3], [1, 3]),
        ((2,), [2]),
        ("2", [0, 1]),
        ("0,1", [0, 1]),
        ("1,", [1]),
        (" 1, 3 ", [1, 3]),
        ("[0, 1]", [0, 1]),
        (-1, [0, 1, 2, 3]),
        ("-1", [0, 1, 2, 3]),
        ("auto", [0, 1, 2, 3]),
    ],
)
def test_parse_device_indices(devices: Any, expected: list[int]) -> None:
    assert parse_device_indices(devices, available=4, kind="CUDA") == expected


@pytest.mark.parametrize(
    ("devices", "why"),
    [
        (0, "zero devices cannot run anything. Pass 1 or more, or 'auto'."),
        (-2, "a negative count other than -1 has no meaning"),
        (True, "a bool is not a device count"),
        ([0, 0], "a device index is listed twice. List each device once."),
        ([], "an empty list selects no device. List at least one device index."),
        ([1, -1], "device indices cannot be negative. Use indices from 0 up."),
        ([0, True], "expected an int, a list of ints, a string like '0,1', or 'auto'"),
        (1.5, "expected an int, a list of ints, a string like '0,1', or 'auto'"),
        ("gpu0", "not a number or a comma-separated list of numbers. Pass e.g. 2, '0,1' or 'auto'."),
    ],
)
def test_parse_device_indices_errors(devices: Any, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"Fabric(devices={devices!r}): {why}")):
        parse_device_indices(devices, available=4, kind="CUDA")


@pytest.mark.parametrize(("devices", "asked"), [(5, "[0, 1, 2, 3, 4]"), ([0, 4], "[0, 4]"), ([7], "[7]")])
def test_parse_device_indices_too_many_says_how_many_exist(devices: Any, asked: str) -> None:
    with pytest.raises(
        ValueError,
        match=re.escape(f"asks for CUDA device(s) {asked} but only 4 CUDA device(s) exist here. Ask for at most 4"),
    ):
        parse_device_indices(devices, available=4, kind="CUDA")


@pytest.mark.parametrize("devices", ["auto", -1])
def test_parse_device_indices_with_none_available(devices: Any) -> None:
    with pytest.raises(ValueError, match=r"no MPS device is available. Choose another accelerator."):
        parse_device_indices(devices, available=0, kind="MPS")


def test_parse_device_indices_error_shows_the_string_as_passed() -> None:
    with pytest.raises(ValueError, match=re.escape("Fabric(devices='0,0'): a device index is listed twice")):
        parse_device_indices("0,0", available=4, kind="CUDA")


# -- GPUs on this machine ---------------------------------------------------------------------------------
def test_cuda_availability_matches_torch() -> None:
    assert CUDAAccelerator.is_available() is (torch.cuda.is_available() and torch.cuda.device_count() > 0)
    expected = torch.cuda.device_count() if torch.cuda.is_available() else 0
    assert CUDAAccelerator.auto_device_count() == expected


def test_mps_availability_matches_torch() -> None:
    assert MPSAccelerator.is_available() is bool(torch.backends.mps.is_available())
    assert MPSAccelerator.auto_device_count() == (1 if torch.backends.mps.is_available() else 0)


def test_no_gpu_here_means_unavailable_and_no_device_to_parse() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    assert not CUDAAccelerator.is_available()
    with pytest.raises(ValueError, match=r"no CUDA device is available"):
        CUDAAccelerator.parse_devices("auto")
    with pytest.raises(ValueError, match=r"only 0 CUDA device\(s\) exist here"):
        CUDAAccelerator.parse_devices(1)


def test_gpu_parallel_devices() -> None:
    assert CUDAAccelerator.get_parallel_devices([0, 2]) == [torch.device("cuda", 0), torch.device("cuda", 2)]
    assert MPSAccelerator.get_parallel_devices([0]) == [torch.device("mps", 0)]


def test_gpu_setup_device_rejects_cpu() -> None:
    with pytest.raises(ValueError, match=r"CUDAAccelerator.setup_device\(cpu\): not a CUDA device"):
        CUDAAccelerator().setup_device(torch.device("cpu"))
    with pytest.raises(ValueError, match=r"MPSAccelerator.setup_device\(cpu\): not an MPS device"):
        MPSAccelerator().setup_device(torch.device("cpu"))


@pytest.mark.cuda
def test_cuda_setup_puts_model_on_the_gpu() -> None:
    fabric = Fabric(accelerator="cuda", devices=1)
    assert isinstance(fabric.accelerator, CUDAAccelerator)
    assert fabric.device == torch.device("cuda", 0)
    model = fabric.setup(torch.nn.Linear(4, 2))
    assert all(p.device == torch.device("cuda", 0) for p in model.parameters())
    out = model(torch.randn(3, 4, device=fabric.device))
    assert out.device == torch.device("cuda", 0)
    assert torch.cuda.current_device() == 0


@pytest.mark.cuda
def test_cuda_16_mixed_has_a_grad_scaler() -> None:
    from fabric import MixedPrecision

    fabric = Fabric(accelerator="cuda", devices=1, precision="16-mixed")
    precision = fabric.strategy.precision
    assert isinstance(precision, MixedPrecision)
    assert isinstance(precision.scaler, torch.amp.GradScaler)
    assert precision.requires_fabric_backward


@pytest.mark.mps
def test_mps_setup_puts_model_on_the_apple_gpu() -> None:
    fabric = Fabric(accelerator="mps", devices=1)
    model = fabric.setup(torch.nn.Linear(4, 2))
    assert all(p.device.type == "mps" for p in model.parameters())
