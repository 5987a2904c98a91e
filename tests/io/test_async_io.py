"""AsyncCheckpointIO in one process: snapshot semantics, ordering, waiting, errors, and what the snapshot keeps."""

from __future__ import annotations

import gc
import pickle
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fabric import AsyncCheckpointIO, CheckpointIO, Fabric, TorchCheckpointIO
from fabric.io._snapshot import BufferPool


class _GatedIO(TorchCheckpointIO):
    """A real TorchCheckpointIO whose writes wait for the test to open a gate, and that records the order."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.events: list[str] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        self.events.append(f"start {Path(path).name}")
        self.gate.wait()
        super().save_checkpoint(checkpoint, path, storage_options)
        self.events.append(f"end {Path(path).name}")


def _fabric(io: CheckpointIO | None = None) -> Fabric:
    return Fabric(accelerator="cpu", devices=1, plugins=[io or AsyncCheckpointIO()])


def _model_and_optimizer(fabric: Fabric) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = nn.Linear(8, 4)
    model, optimizer = fabric.setup(model, torch.optim.Adam(model.parameters(), lr=0.1))
    fabric.backward(model(torch.randn(2, 8)).sum())
    optimizer.step()
    return model, optimizer


def test_save_returns_before_the_write_and_the_file_holds_the_values_at_the_call(tmp_path: Path) -> None:
    io = _GatedIO()
    fabric = _fabric(AsyncCheckpointIO(io))
    model, optimizer = _model_and_optimizer(fabric)
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moment = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    log = ["a", "b"]
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, "log": log})
    assert io.events == ["start ckpt.pt"], "save returned while the write waits at the gate"
    # Change everything right after the call: weights, optimizer moments, a plain list.
    fabric.backward(model(torch.randn(2, 8)).sum())
    optimizer.step()
    with torch.no_grad():
        model.weight.fill_(7.0)
    log.append("c")
    io.gate.set()
    fabric.barrier()
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    for key, value in expected.items():
        assert torch.equal(saved["model"][key], value), key
    assert torch.equal(saved["optimizer"]["state"][0]["exp_avg"], expected_moment)
    assert saved["log"] == ["a", "b"]
    assert saved["model"]._metadata is not None, "the module state dict keeps its version metadata"


def test_a_second_save_waits_for_the_first_and_ends_up_on_disk(tmp_path: Path) -> None:
    io = _GatedIO()
    fabric = _fabric(AsyncCheckpointIO(io))
    fabric.save(tmp_path / "ckpt.pt", {"version": 1, "x": torch.zeros(3)})
    second = threading.Thread(target=fabric.save, args=(tmp_path / "ckpt.pt", {"version": 2, "x": torch.ones(3)}))
    second.start()
    second.join(timeout=0.5)
    assert second.is_alive(), "the second save must wait while the first one is still being written"
    assert io.events == ["start ckpt.pt"]
    io.gate.set()
    second.join()
    fabric.barrier()
    assert io.events == ["start ckpt.pt", "end ckpt.pt", "start ckpt.pt", "end ckpt.pt"]
    saved = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert saved["version"] == 2 and torch.equal(saved["x"], torch.ones(3))


def test_load_and_load_raw_wait_for_the_pending_write(tmp_path: Path) -> None:
    io = _GatedIO()
    fabric = _fabric(AsyncCheckpointIO(io))
    model, _ = _model_and_optimizer(fabric)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "step": 5})
    results: list[dict[str, Any]] = []
    loader = threading.Thread(target=lambda: results.append(fabric.load(tmp_path / "ckpt.pt")))
    loader.start()
    loader.join(timeout=0.5)
    assert loader.is_alive() and not (tmp_path / "ckpt.pt").exists(), "load waits while the file is being written"
    io.gate.set()
    loader.join()
    assert results[0]["step"] == 5 and torch.equal(results[0]["model"]["weight"], model.weight)
    # load_raw right after a save reads the new file, not a missing or older one.
    fresh = nn.Linear(8, 4)
    fabric.save(tmp_path / "weights.pt", model.state_dict())
    fabric.load_raw(tmp_path / "weights.pt", fresh)
    assert torch.equal(fresh.weight, model.weight)


def test_a_failed_background_write_is_raised_once_by_the_next_call_naming_the_path(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the checkpoint's folder should be")
    bad = blocker / "ckpt.pt"
    fabric = _fabric()
    fabric.save(tmp_path / "good.pt", {"version": 1})
    fabric.save(bad, {"version": 2})  # returns: the write fails in the background
    expected = (
        r"save\('.*not_a_dir/ckpt.pt'\): the background write of this checkpoint failed "
        r"\((FileExistsError|NotADirectoryError): .*Fix the cause and save again"
    )
    with pytest.raises(RuntimeError, match=expected) as info:
        fabric.save(tmp_path / "good.pt", {"version": 3})
    assert isinstance(info.value.__cause__, OSError)
    assert torch.load(tmp_path / "good.pt", weights_only=False) == {"version": 1}, "the failed call saved nothing"
    fabric.save(tmp_path / "good.pt", {"version": 3})  # the error was reported: saving works again
    fabric.barrier()
    assert torch.load(tmp_path / "good.pt", weights_only=False) == {"version": 3}


@pytest.mark.parametrize("call", ["barrier", "load", "teardown"])
def test_barrier_load_and_teardown_raise_a_failed_background_write(tmp_path: Path, call: str) -> None:
    (tmp_path / "file").write_text("")
    fabric = _fabric()
    fabric.save(tmp_path / "file" / "ckpt.pt", {"x": 1})
    with pytest.raises(RuntimeError, match=r"file/ckpt.pt'\): the background write of this checkpoint failed"):
        if call == "barrier":
            fabric.barrier()
        elif call == "load":
            fabric.load(tmp_path / "file" / "other.pt")
        else:
            fabric.strategy.teardown()


def test_wraps_a_custom_checkpoint_io_and_defaults_to_torch(tmp_path: Path) -> None:
    assert isinstance(AsyncCheckpointIO().checkpoint_io, TorchCheckpointIO)
    inner = _GatedIO()
    inner.gate.set()
    io = AsyncCheckpointIO(inner)
    io.save_checkpoint({"a": torch.ones(2)}, tmp_path / "x.pt")
    assert torch.equal(io.load_checkpoint(tmp_path / "x.pt")["a"], torch.ones(2))
    io.remove_checkpoint(tmp_path / "x.pt")
    assert not (tmp_path / "x.pt").exists()
    assert inner.events == ["start x.pt", "end x.pt"]


def test_constructor_errors() -> None:
    with pytest.raises(TypeError, match=r"AsyncCheckpointIO\(checkpoint_io=str\): expected a CheckpointIO"):
        AsyncCheckpointIO("torch")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"already saves in the background; wrapping it again"):
        AsyncCheckpointIO(AsyncCheckpointIO())


def test_deepspeed_refuses_the_plugin(no_cluster_env: None) -> None:
    pytest.importorskip("deepspeed")
    with pytest.raises(ValueError, match=r"DeepSpeed writes its checkpoints itself.*Remove the plugin"):
        Fabric(accelerator="cpu", devices=2, strategy="deepspeed", plugins=[AsyncCheckpointIO()])


def test_pickles_for_spawned_processes(tmp_path: Path) -> None:
    io = pickle.loads(pickle.dumps(AsyncCheckpointIO()))
    io.save_checkpoint({"a": 1}, tmp_path / "x.pt")
    io.wait()
    assert torch.load(tmp_path / "x.pt", weights_only=False) == {"a": 1}


def test_an_object_that_cannot_be_copied_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    fabric = _fabric()
    with pytest.raises(TypeError, match=r"checkpoint\['lock'\] is a lock that cannot be copied .*AsyncCheckpointIO"):
        fabric.save(tmp_path / "x.pt", {"lock": threading.Lock()})
    assert not (tmp_path / "x.pt").exists()


def test_snapshot_keeps_shared_storage_views_and_parameters() -> None:
    base = torch.arange(6.0)
    param = nn.Parameter(torch.ones(2))
    snapshot = BufferPool().snapshot({"a": base, "view": base[2:4], "same": base, "param": param, "t": (1, [base])})
    base.add_(100)
    assert torch.equal(snapshot["a"], torch.arange(6.0))
    assert snapshot["view"].untyped_storage().data_ptr() == snapshot["a"].untyped_storage().data_ptr()
    assert snapshot["same"] is snapshot["a"] and snapshot["t"][1][0] is snapshot["a"]
    assert torch.equal(snapshot["view"], torch.tensor([2.0, 3.0]))
    assert isinstance(snapshot["param"], nn.Parameter) and snapshot["param"] is not param


def test_snapshot_reuses_its_buffers_for_the_same_tensors_and_frees_the_rest() -> None:
    pool = BufferPool()
    weight, other = torch.randn(1000), torch.randn(10)
    first = pool.snapshot({"w": weight, "o": other})
    pointer = first["w"].data_ptr()
    del first
    weight.add_(1)
    second = pool.snapshot({"w": weight})
    assert second["w"].data_ptr() == pointer and torch.equal(second["w"], weight)
    assert pool.nbytes == weight.nbytes, "the buffer of a tensor no longer saved was released"
    pool.clear()
    assert pool.nbytes == 0


def test_snapshot_copies_large_tensors_in_pieces_on_several_threads() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        large = torch.randn(10_000_001)  # 40 MB: two pieces and a remainder; an odd size ends mid-piece
        offset_view = large[3:]
        snapshot = BufferPool().snapshot({"large": large, "view": offset_view})
    finally:
        torch.set_num_threads(threads)
    expected = large.clone()
    large.zero_()
    assert torch.equal(snapshot["large"], expected) and torch.equal(snapshot["view"], expected[3:])


@pytest.mark.cuda
def test_cuda_tensors_are_copied_to_pinned_cpu_memory() -> None:
    weight = torch.randn(1000, device="cuda")
    snapshot = BufferPool().snapshot({"w": weight})
    weight.add_(1)
    assert snapshot["w"].device.type == "cpu" and snapshot["w"].is_pinned()
    assert torch.equal(snapshot["w"], (weight - 1).cpu())


def test_the_docs_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    page = (Path(__file__).resolve().parents[2] / "docs" / "checkpoints.md").read_text()
    section = page.split("## Asynchronous saves", 1)[1]
    example = section.split("```python\n", 1)[1].split("```", 1)[0]
    monkeypatch.chdir(tmp_path)
    exec(compile(example, "docs/checkpoints.md", "exec"), {})
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=False)["step"] == 30


def test_background_sharded_save_to_a_url_is_refused() -> None:
    fabric = Fabric(accelerator="cpu", strategy="fsdp", devices=2, plugins=[AsyncCheckpointIO()])
    with pytest.raises(ValueError, match=r"'memory://run/ckpt'\) with AsyncCheckpointIO: background sharded saves"):
        fabric.strategy.save_checkpoint("memory://run/ckpt", {"step": 1})


def _mapped(address: int) -> bool:
    """Whether `address` lies in a mapping of this process (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        start, end = (int(part, 16) for part in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


def _in_child(job: Any) -> str:
    """Run `job()` in a forked child; return what it returned (a string), or its traceback."""
    import os
    import traceback

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        try:
            answer = str(job())
        except BaseException:
            answer = traceback.format_exc()
        os.write(write, answer.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as stream:
        answer = stream.read()
    os.waitpid(pid, 0)
    return answer


needs_dontfork = pytest.mark.skipif(
    not __import__("fabric.io._buffers", fromlist=["_"]).dontfork_supported(), reason="needs Linux MADV_DONTFORK"
)


@needs_dontfork
def test_a_forked_child_does_not_inherit_the_snapshot_buffers_and_the_parent_keeps_them(tmp_path: Path) -> None:
    io = AsyncCheckpointIO()
    weights = torch.arange(1_000_000, dtype=torch.float32)  # 4 MB: a buffer of its own mapping
    io.save_checkpoint({"w": weights}, tmp_path / "x.pt")
    io.wait()
    (buffer,) = io._pool._buffers.values()
    address, last = buffer.data_ptr(), buffer.data_ptr() + buffer.nbytes() - 1
    assert _mapped(address) and _mapped(last)
    child = _in_child(lambda: (_mapped(address), _mapped(last)))
    assert child == "(False, False)", child
    # The parent's buffer is intact and still reused by the next save.
    assert torch.equal(torch.frombuffer(bytearray(buffer), dtype=torch.float32), weights)
    weights.add_(1)
    io.save_checkpoint({"w": weights}, tmp_path / "x.pt")
    io.wait()
    reused = next(iter(io._pool._buffers.values())).data_ptr()
    assert reused == address
    assert torch.equal(torch.load(tmp_path / "x.pt")["w"], weights)
    del buffer
    io.teardown()
    gc.collect()  # a buffer is unmapped when its storage's last reference goes; a cycle may hold one until then
    assert not _mapped(address), "freeing the pool unmaps its buffers"


@needs_dontfork
def test_a_forked_child_saves_with_fresh_buffers_and_never_reads_the_inherited_ones(tmp_path: Path) -> None:
    io = AsyncCheckpointIO()
    weights = torch.randn(1_000_000)
    io.save_checkpoint({"w": weights}, tmp_path / "parent.pt")
    io.wait()
    inherited = next(iter(io._pool._buffers.values()))
    address = inherited.data_ptr()

    def save_in_child() -> str:
        # The same tensor again: reusing the inherited buffer would crash the child (SIGSEGV), it is not mapped
        # here. (No tensor math in the child: OpenMP's thread pool does not survive fork().)
        io.save_checkpoint({"w": weights}, tmp_path / "child.pt")
        io.wait()
        reused = any(buffer is inherited for buffer in io._pool._buffers.values())
        return f"saved, reused={reused}"

    assert _in_child(save_in_child) == "saved, reused=False"
    assert torch.equal(torch.load(tmp_path / "child.pt")["w"], weights)
    assert torch.equal(torch.load(tmp_path / "parent.pt")["w"], weights)
    assert _mapped(address), "the parent's buffer was not unmapped by the child"
