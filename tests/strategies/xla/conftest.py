"""A fake torch_xla that records what fabric asks of it, so the multi-process paths run without torch_xla.

Multi-process XLA cannot run on a CPU (pytorch/xla#9496): these fakes stand in for torch_xla's launcher, runtime
and collectives, with tensors on the CPU, and `calls` lists every call in order.
"""

from __future__ import annotations

import os
import pickle
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn


class FakeXLA:
    """State and call log shared by the fake modules."""

    def __init__(self, devices: int) -> None:
        self.devices = devices
        self.ordinal = 0
        self.calls: list[tuple] = []
        # What a rendezvous hands back from every process; by default each sends what this one sent.
        self.peer_payloads: list[bytes] | None = None

    def names(self) -> list[str]:
        return [call[0] for call in self.calls]


def _build(fake: FakeXLA) -> dict[str, types.ModuleType]:
    modules = {name: types.ModuleType(name) for name in (
        "torch_xla", "torch_xla.core", "torch_xla.core.xla_model", "torch_xla.core.functions", "torch_xla.runtime",
        "torch_xla._internal", "torch_xla._internal.tpu", "torch_xla.distributed",
        "torch_xla.distributed.xla_multiprocessing", "torch_xla.distributed.parallel_loader",
        "torch_xla.distributed.fsdp", "torch_xla.distributed.fsdp.wrap",
    )}  # fmt: skip
    root, xm, xf, xr = (modules[n] for n in ("torch_xla", "torch_xla.core.xla_model", "torch_xla.core.functions",
                                            "torch_xla.runtime"))  # fmt: skip
    root.device = lambda index=None: torch.device("cpu")  # type: ignore[attr-defined]
    root.sync = lambda: fake.calls.append(("sync",))  # type: ignore[attr-defined]
    root.runtime = xr  # type: ignore[attr-defined]

    def all_reduce(reduce_type: str, value: torch.Tensor) -> torch.Tensor:
        fake.calls.append(("all_reduce", reduce_type, value.clone()))
        return value * fake.devices if reduce_type == "sum" else value.clone()

    def all_gather(value: torch.Tensor) -> torch.Tensor:
        fake.calls.append(("all_gather", tuple(value.shape)))
        return torch.cat([value] * fake.devices)

    def differentiable_all_gather(value: torch.Tensor) -> torch.Tensor:
        fake.calls.append(("differentiable_all_gather", tuple(value.shape)))
        return torch.cat([value] * fake.devices)

    def collective_broadcast(tensors: list[torch.Tensor], root_ordinal: int = 0) -> None:
        fake.calls.append(("collective_broadcast", root_ordinal))

    def rendezvous(tag: str, payload: bytes = b"") -> list[bytes]:
        fake.calls.append(("rendezvous", tag, payload))
        return fake.peer_payloads or [payload] * fake.devices

    def optimizer_step(optimizer: Any, barrier: bool = False, optimizer_args: dict | None = None) -> Any:
        fake.calls.append(("optimizer_step", barrier, optimizer_args))
        return optimizer.step(**(optimizer_args or {}))

    xm.all_reduce, xm.all_gather, xm.collective_broadcast = all_reduce, all_gather, collective_broadcast  # type: ignore[attr-defined]
    xm.rendezvous, xm.optimizer_step = rendezvous, optimizer_step  # type: ignore[attr-defined]
    xm.broadcast_master_param = lambda module: fake.calls.append(("broadcast_master_param",))  # type: ignore[attr-defined]
    xm.get_xla_supported_devices = lambda: ["xla:0"]  # type: ignore[attr-defined]
    xf.all_gather = differentiable_all_gather  # type: ignore[attr-defined]
    xr.world_size = lambda: fake.devices  # type: ignore[attr-defined]
    xr.global_ordinal = lambda: fake.ordinal  # type: ignore[attr-defined]
    xr.local_ordinal = lambda: fake.ordinal  # type: ignore[attr-defined]
    xr.host_index = lambda: 0  # type: ignore[attr-defined]
    modules["torch_xla._internal.tpu"].num_available_devices = lambda: fake.devices  # type: ignore[attr-defined]

    def spawn(fn: Any, args: tuple = (), nprocs: int | None = None, start_method: str = "spawn") -> None:
        fake.calls.append(("spawn", nprocs, start_method))
        os.environ["PJRT_LOCAL_PROCESS_COUNT"] = str(fake.devices)  # as torch_xla's launched processes have it
        for ordinal in range(1 if nprocs == 1 else fake.devices):
            fake.ordinal = ordinal
            # Every real process gets its own copy of the function and arguments (torch_xla pickles them).
            fn(ordinal, *pickle.loads(pickle.dumps(args)))
        fake.ordinal = 0

    modules["torch_xla.distributed.xla_multiprocessing"].spawn = spawn  # type: ignore[attr-defined]
    modules["torch_xla.distributed.parallel_loader"].MpDeviceLoader = FakeMpDeviceLoader  # type: ignore[attr-defined]
    fsdp = modules["torch_xla.distributed.fsdp"]
    fsdp.XlaFullyShardedDataParallel = FakeXlaFSDP  # type: ignore[attr-defined]
    fsdp.checkpoint_module = lambda module: module  # type: ignore[attr-defined]
    modules["torch_xla.distributed.fsdp.wrap"].transformer_auto_wrap_policy = _fake_policy  # type: ignore[attr-defined]
    return modules


def _fake_policy(*args: Any, **kwargs: Any) -> bool:
    return False


class FakeMpDeviceLoader:
    """Records the loader and device it wraps; yields the loader's batches."""

    def __init__(self, loader: Any, device: torch.device) -> None:
        self._loader = loader
        self.device = device

    def __iter__(self) -> Iterator[Any]:
        return iter(self._loader)

    def __len__(self) -> int:
        return len(self._loader)


class FakeXlaFSDP(nn.Module):
    """Wraps a module like XlaFullyShardedDataParallel, marking its parameters sharded; records its arguments."""

    def __init__(self, module: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.module = module
        self.kwargs = kwargs
        self.clipped: list[tuple] = []
        for param in module.parameters():
            param._is_sharded = True  # type: ignore[attr-defined]

    def forward(self, *args: Any) -> Any:
        return self.module(*args)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        self.clipped.append((max_norm, norm_type))
        return torch.tensor(1.0)

    def no_sync(self) -> Any:
        from contextlib import nullcontext

        self.clipped.append(("no_sync",))
        return nullcontext()


@pytest.fixture
def fake_xla(monkeypatch: pytest.MonkeyPatch) -> FakeXLA:
    """torch_xla faked on a TPU host with 4 devices (`fake_xla.devices` changes it)."""
    fake = FakeXLA(devices=4)
    for name, module in _build(fake).items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv("PJRT_DEVICE", "TPU")
    # The fake's device is the CPU (so that tensors compute); the accelerator would rightly refuse it.
    from fabric.accelerators.xla import XLAAccelerator

    monkeypatch.setattr(XLAAccelerator, "setup_device", lambda self, device: None)
    return fake
