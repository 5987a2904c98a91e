"""Issue 14: GPU code paths checked on the CPU, with CUDA faked through torch's public functions.

`fake_cuda` makes torch report two GPUs and replaces torch.cuda._lazy_init by a function that raises, so any step
that would initialise CUDA in the parent process (and so poison ddp_fork) fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

from fabric import CUDAAccelerator, Fabric
from fabric.accelerators import cuda as cuda_module

pytestmark = pytest.mark.usefixtures("no_cluster_env")


class _CudaInitialised(AssertionError):
    pass


def _refuse_init() -> None:
    raise _CudaInitialised("CUDA was initialised in the parent process")


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "_lazy_init", _refuse_init)
    yield
    assert not torch.cuda.is_initialized()


# -- detection ------------------------------------------------------------------------------------------
def _env_after_import(value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    if value is not None:
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = value
    code = "import os, fabric; print(os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK'))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout


def test_import_turns_on_nvml_based_cuda_checks() -> None:
    assert _env_after_import(None).strip() == "1"


def test_import_keeps_the_users_own_setting() -> None:
    assert _env_after_import("0").strip() == "0"


def test_gpu_count_does_not_ask_is_available(monkeypatch: pytest.MonkeyPatch) -> None:
    def initialises_the_driver() -> bool:
        raise AssertionError("torch.cuda.is_available() initialises the driver without NVML-based checks")

    monkeypatch.setattr(torch.cuda, "is_available", initialises_the_driver)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    assert CUDAAccelerator.is_available()
    assert CUDAAccelerator.auto_device_count() == 3
    assert CUDAAccelerator.parse_devices("auto") == [0, 1, 2]


# -- bf16 checks must not initialise CUDA in the parent -----------------------------------------------------
@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_notebook", "ddp_spawn", "ddp"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_on_gpus_builds_without_initialising_cuda(fake_cuda: None, strategy: str, precision: str) -> None:
    fabric = Fabric(accelerator="cuda", strategy=strategy, devices=2, precision=precision)
    assert fabric.strategy.parallel_devices == [torch.device("cuda", 0), torch.device("cuda", 1)]
    assert not torch.cuda.is_initialized()


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_on_a_gpu_without_it_fails_at_launch(
    fake_cuda: None, monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    fabric = Fabric(accelerator="cuda", devices=1, precision=precision)
    # In the launched process CUDA may be initialised: fake a GPU older than bfloat16.
    monkeypatch.setattr(CUDAAccelerator, "setup_device", lambda self, device: None)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla K80")
    with pytest.raises(
        ValueError,
        match=rf"Fabric\(precision='{precision}'\): the GPU cuda:0 \(Tesla K80\) does not support bfloat16\. "
        r"Use precision='16-mixed'",
    ):
        fabric.launch()


def test_bf16_check_passes_on_a_gpu_with_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    cuda_module.check_bf16_supported(torch.device("cuda", 0), "bf16-true")
    cuda_module.check_bf16_supported(torch.device("cpu"), "bf16-true")  # not a GPU: nothing to check


def test_bf16_is_checked_at_once_where_cuda_is_already_up(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla K80")
    with pytest.raises(ValueError, match=r"Fabric\(precision='bf16-mixed'\): the GPU cuda:0 \(Tesla K80\)"):
        Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
