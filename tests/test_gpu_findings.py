"""Issue 14: GPU code paths checked on the CPU, with CUDA faked through torch's public functions.

`fake_cuda` makes torch report two GPUs and replaces torch.cuda._lazy_init by a function that raises, so any step
that would initialise CUDA in the parent process (and so poison ddp_fork) fails the test.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

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
@pytest.mark.parametrize("strategy", ["ddp_fork", "ddp_notebook", "ddp_spawn", "ddp", "fsdp", "deepspeed"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true", "16-mixed", "16-true", "32-true"])
def test_fabric_on_gpus_builds_without_initialising_cuda(fake_cuda: None, strategy: str, precision: str) -> None:
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


# -- FSDP -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("precision", "dtype"), [("32-true", torch.float32), ("bf16-true", torch.bfloat16)])
def test_fsdp_init_module_builds_on_the_cpu_not_on_every_gpu(
    fake_cuda: None, precision: str, dtype: torch.dtype
) -> None:
    from fabric.strategies import FSDPStrategy

    for strategy in (FSDPStrategy(), FSDPStrategy(cpu_offload=True)):
        fabric = Fabric(accelerator="cuda", strategy=strategy, devices=2, precision=precision)
        with fabric.strategy.module_init_context(empty_init=False):
            model = torch.nn.Linear(4, 4)
        assert model.weight.device == torch.device("cpu") and model.weight.dtype == dtype
        with fabric.strategy.module_init_context(empty_init=True):
            assert torch.nn.Linear(4, 4).weight.is_meta


def test_fsdp_keeps_the_users_grad_scaler_settings() -> None:
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    from fabric.precision import MixedPrecision

    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_factor=4.0, growth_interval=7)
    plugin = MixedPrecision("16-mixed", device="cpu", scaler=scaler)
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2, plugins=[plugin])
    sharded = fabric.strategy.precision.scaler  # type: ignore[attr-defined]
    assert isinstance(sharded, ShardedGradScaler)
    assert sharded.state_dict() == scaler.state_dict()
    assert (sharded.get_scale(), sharded.get_growth_factor(), sharded.get_growth_interval()) == (1024.0, 4.0, 7)


# -- precision ------------------------------------------------------------------------------------------
def test_16_mixed_on_mps_scales_the_loss() -> None:
    from fabric.precision import MixedPrecision

    plugin = MixedPrecision("16-mixed", device="mps")
    assert isinstance(plugin.scaler, torch.amp.GradScaler)
    assert plugin.has_loss_scaler and plugin.requires_fabric_backward


# -- process group --------------------------------------------------------------------------------------
def test_process_group_is_bound_to_the_gpu_and_collectives_follow_the_live_backend(
    fake_cuda: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The strategy asks for NCCL on cuda:0; the group that really exists is gloo (no GPU here).

    NCCL gets device_id so its communicator is bound at once; barrier and broadcast pick their device from the
    backend that really runs, not the configured name (a user's or torchrun's group may differ).
    """
    from fabric.strategies import parallel

    calls: list[dict[str, Any]] = []
    real_init = parallel._dist.init_process_group

    def record(backend: str, *args: Any, device_id: torch.device | None = None) -> None:
        calls.append({"backend": backend, "device_id": device_id})
        real_init("gloo", *args)

    monkeypatch.setattr(parallel._dist, "init_process_group", record)
    monkeypatch.setattr(CUDAAccelerator, "setup_device", lambda self, device: None)
    fabric = Fabric(accelerator="cuda", strategy="ddp", devices=1)
    fabric.launch()
    assert calls == [{"backend": "nccl", "device_id": torch.device("cuda", 0)}]
    fabric.barrier()
    assert fabric.broadcast({"step": 3}) == {"step": 3}
    fabric.strategy.teardown()
