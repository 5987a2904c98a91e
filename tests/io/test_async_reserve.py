"""AsyncCheckpointIO.reserve: the first save's buffers made and faulted in ahead, and Fabric's first-step hook."""

from __future__ import annotations

import ctypes
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fabric import AsyncCheckpointIO, Fabric
from fabric.io import _snapshot
from fabric.io._snapshot import BufferPool
from tests.io.test_async_io import _in_child, _mapped, needs_dontfork

MIB = 1 << 20


def _count_allocations(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Sizes of the buffers of 1 MiB and more that snapshots allocate (not the reserving thread's)."""
    sizes: list[int] = []
    allocate = _snapshot._cpu_buffer

    def counting(nbytes: int, pinned: bool) -> torch.UntypedStorage:
        if threading.current_thread().name != "fabric-reserve" and nbytes >= MIB:
            sizes.append(nbytes)
        return allocate(nbytes, pinned)

    monkeypatch.setattr(_snapshot, "_cpu_buffer", counting)
    return sizes


def _resident(storage: torch.UntypedStorage) -> bool:
    """Whether every page of a page-aligned buffer is in memory (mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = 4096
    pages = (storage.nbytes() + page - 1) // page
    vector = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(storage.data_ptr()), ctypes.c_size_t(storage.nbytes()), vector) == 0
    return all(byte & 1 for byte in vector)


@needs_dontfork
def test_reserved_buffers_are_faulted_in_and_taken_by_the_first_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    pool = BufferPool()
    state = {"a": torch.randn(MIB), "b": torch.randn(MIB // 2), "small": torch.randn(10), "view": None}
    state["view"] = state["a"][5:]  # the same storage: reserved once
    assert pool.reserve(state) == 6 * MIB
    pool._collect_reservation()
    reserved = [buffer for buffers in pool._spare.values() for buffer in buffers]
    assert sorted(buffer.nbytes() for buffer in reserved) == [2 * MIB, 4 * MIB]
    assert all(_resident(buffer) for buffer in reserved), "the reserving thread faulted every page in"
    allocations = _count_allocations(monkeypatch)
    snapshot = pool.snapshot(state)
    assert allocations == [], "the first snapshot allocated nothing: it copied into the reserved buffers"
    assert {snapshot["a"].data_ptr(), snapshot["b"].data_ptr()} == {buffer.data_ptr() for buffer in reserved}
    assert torch.equal(snapshot["a"], state["a"]) and torch.equal(snapshot["view"], state["a"][5:])
    assert pool.reserve(state) == 0, "held buffers are not reserved again"


def test_unused_reserved_buffers_are_freed_by_the_next_snapshot() -> None:
    pool = BufferPool()
    assert pool.reserve({"a": torch.randn(MIB), "b": torch.randn(MIB // 2)}) == 6 * MIB
    pool.snapshot({"other": torch.randn(10)})
    assert pool.nbytes == 40, "only the small tensor's copy is held"


@needs_dontfork
def test_a_forked_child_forgets_reserved_buffers_without_touching_them(tmp_path: Path) -> None:
    io = AsyncCheckpointIO()
    weights = torch.randn(MIB)
    io.reserve({"w": weights})
    io._pool._collect_reservation()
    (reserved,) = io._pool._spare[(False, 4 * MIB)]

    def save_in_child() -> str:
        # Reading the inherited buffer would crash the child (SIGSEGV): it is not mapped here.
        mapped = _mapped(reserved.data_ptr())
        io.save_checkpoint({"w": weights}, tmp_path / "child.pt")
        io.wait()
        used = next(iter(io._pool._buffers.values()))
        return f"mapped={mapped}, reused={used is reserved}"

    assert _in_child(save_in_child) == "mapped=False, reused=False"
    assert torch.equal(torch.load(tmp_path / "child.pt")["w"], weights)
    io.save_checkpoint({"w": weights}, tmp_path / "parent.pt")
    io.wait()
    assert next(iter(io._pool._buffers.values())) is reserved, "the parent's first save takes it"
    io.teardown()


def _setup(fabric: Fabric, optimizers: int = 1) -> tuple[Any, list[Any]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 512), nn.Linear(512, 4))  # weight 2 MiB, the rest below 1 MiB
    opts = [torch.optim.Adam(layer.parameters()) for layer in list(model)[:optimizers]]
    model, *opts = fabric.setup(model, *opts)
    return model, opts


def _step(fabric: Fabric, model: Any, optimizer: Any) -> None:
    fabric.backward(model(torch.randn(2, 1024)).sum())
    optimizer.step()
    optimizer.zero_grad()


@needs_dontfork
def test_fabric_reserves_after_the_first_step_and_the_first_save_allocates_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    io = AsyncCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, (optimizer,) = _setup(fabric)
    raw = optimizer.optimizer
    reserve = io.reserve
    reserved: list[int] = []
    monkeypatch.setattr(io, "reserve", lambda state: reserved.append(reserve(state)))
    assert len(raw._optimizer_step_post_hooks) == 1
    _step(fabric, model, optimizer)
    assert reserved == [6 * MIB], "the weight, Adam's exp_avg and exp_avg_sq of the 2 MiB layer"
    assert len(raw._optimizer_step_post_hooks) == 0, "the one-shot hook removed itself"
    _step(fabric, model, optimizer)
    assert reserved == [6 * MIB]
    allocations = _count_allocations(monkeypatch)
    state = {"model": model, "optimizer": optimizer, "step": 2}
    fabric.save(tmp_path / "async.pt", state)
    fabric.barrier()
    assert allocations == []
    sync = Fabric(accelerator="cpu", devices=1)
    sync.save(tmp_path / "sync.pt", state)
    assert (tmp_path / "async.pt").read_bytes() == (tmp_path / "sync.pt").read_bytes()


def test_without_async_saves_no_hook_is_registered() -> None:
    _, (optimizer,) = _setup(Fabric(accelerator="cpu", devices=1))
    assert len(optimizer.optimizer._optimizer_step_post_hooks) == 0


def test_with_several_optimizers_fabric_reserves_once_all_have_stepped(monkeypatch: pytest.MonkeyPatch) -> None:
    io = AsyncCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, (first, second) = _setup(fabric, optimizers=2)
    calls: list[Any] = []
    monkeypatch.setattr(io, "reserve", calls.append)
    fabric.backward(model(torch.randn(2, 1024)).sum())
    first.step()
    first.step()
    assert calls == []
    second.step()
    assert len(calls) == 1 and calls[0]["optimizers"] == [first.optimizer, second.optimizer]


def test_a_hook_registered_after_fabric_s_is_kept_and_fabric_s_goes_at_the_next_save(tmp_path: Path) -> None:
    io = AsyncCheckpointIO()
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[io])
    model, (optimizer,) = _setup(fabric)
    steps: list[int] = []
    optimizer.optimizer.register_step_post_hook(lambda *args: steps.append(1))
    _step(fabric, model, optimizer)  # removing Fabric's hook now would break the optimizer's loop over its hooks
    _step(fabric, model, optimizer)
    assert steps == [1, 1] and len(optimizer.optimizer._optimizer_step_post_hooks) == 2
    fabric.save(tmp_path / "ckpt.pt", {"model": model})
    assert len(optimizer.optimizer._optimizer_step_post_hooks) == 1
    fabric.barrier()


def test_teardown_removes_the_hooks_of_optimizers_that_never_stepped() -> None:
    io = AsyncCheckpointIO()
    _, (first, second) = _setup(Fabric(accelerator="cpu", devices=1, plugins=[io]), optimizers=2)
    io.teardown()
    assert len(first.optimizer._optimizer_step_post_hooks) == len(second.optimizer._optimizer_step_post_hooks) == 0


def test_every_state_dict_of_the_state_counts_though_each_is_made_fresh() -> None:
    class Holder:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def state_dict(self) -> dict[str, Any]:
            return {"t": self.tensor}  # a new dict each call, freed once walked

    holders = [Holder(torch.randn(MIB // 4)) for _ in range(4)]
    assert len(_snapshot.storages_to_copy({"holders": holders})) == 4
