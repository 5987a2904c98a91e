"""The uneven all_gather's header packing and its whole flow, over a world of ranks simulated by threads.

Each thread plays one rank; the fake strategy's all_gather stacks what every thread passed, exactly as
torch.distributed's all_gather would. Real 2-process runs are in tests/integration/test_uneven_gather.py.
"""

from __future__ import annotations

import threading
from collections import namedtuple
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor

from fabric import _collectives, _uneven_gather
from fabric.utilities.exceptions import FabricValueError


class _World:
    """What the threads share: one slot per rank and a barrier per gather."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.slots: list[Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=10)
        self.calls: list[list[tuple[tuple[int, ...], torch.device]]] = [[] for _ in range(size)]


class _ThreadRankStrategy:
    """The parts of a Strategy the gather uses, for one thread-rank of a `_World`."""

    def __init__(self, world: _World, rank: int, device: str = "cpu") -> None:
        self.world, self.global_rank, self.world_size = world, rank, world.size
        self.root_device = torch.device(device)

    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        self.world.calls[self.global_rank].append((tuple(tensor.shape), tensor.device))
        self.world.slots[self.global_rank] = tensor
        self.world.barrier.wait()
        parts = [t for t in self.world.slots if t is not None]
        if len({p.shape for p in parts}) > 1 or len({p.dtype for p in parts}) > 1:
            raise AssertionError("a real gloo all_gather would fail or hang here: shapes or dtypes differ")
        result = torch.stack([p.detach().clone() for p in parts])
        self.world.barrier.wait()  # nobody overwrites a slot before everybody has read it
        return result


def _run(size: int, make_data: Callable[[int], Any], sync_grads: bool = False) -> tuple[list[Any], _World]:
    """Call fabric's all_gather on `size` thread-ranks; each result is the gathered data or the exception raised."""
    world = _World(size)
    results: list[Any] = [None] * size

    def rank_main(rank: int) -> None:
        strategy: Any = _ThreadRankStrategy(world, rank)
        try:
            results[rank] = _collectives.all_gather(strategy, make_data(rank), None, sync_grads, uneven=True)
        except Exception as err:  # reported per rank, asserted by the test
            results[rank] = err

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results, world


def test_header_packs_count_paths_dtypes_and_shapes() -> None:
    tensors = [torch.zeros(2, 3), torch.zeros((), dtype=torch.int64)]
    header = _uneven_gather.pack_header(tensors, ["['a']", "['b']"])
    assert header[0] == len(header) == 3 + (2 + 2) + (2 + 0)
    assert header[1] == 2
    infos = _uneven_gather.unpack_header(header)
    assert [info.shape for info in infos] == [(2, 3), ()]
    assert infos[0].dtype_code != infos[1].dtype_code
    assert [info.numel for info in infos] == [6, 1]


def test_tensor_paths_follow_the_collection_order() -> None:
    Point = namedtuple("Point", ["x", "y"])

    @dataclass
    class Out:
        logits: Tensor
        name: str

    data = {"a": torch.zeros(1), "b": [Point(torch.zeros(1), 3), Out(torch.zeros(1), "n")]}
    assert list(_uneven_gather.tensor_paths(data)) == ["['a']", "['b'][0].x", "['b'][1].logits"]
    assert list(_uneven_gather.tensor_paths(torch.zeros(1))) == ["data"]


def test_equal_shapes_keep_the_stacked_contract() -> None:
    results, world = _run(2, lambda r: {"x": torch.full((2, 3), float(r)), "n": r})
    for result in results:
        assert torch.equal(result["x"], torch.stack([torch.zeros(2, 3), torch.ones(2, 3)]))
        assert torch.equal(result["n"], torch.tensor([0, 1]))
    # One header exchange for both tensors, then one gather per tensor, unpadded.
    assert [shape for shape, _ in world.calls[0]] == [(_uneven_gather.HEADER_SLOTS,), (2, 3), ()]


@pytest.mark.parametrize("size", [2, 3])
def test_uneven_rows_come_back_as_what_each_rank_sent(size: int) -> None:
    def data(rank: int) -> Any:
        return {"rows": torch.arange(rank * 4.0).view(rank * 2, 2), "loss": torch.tensor(rank * 1.0)}

    results, world = _run(size, data)
    for result in results:
        assert isinstance(result["rows"], list) and len(result["rows"]) == size
        for rank, tensor in enumerate(result["rows"]):
            assert torch.equal(tensor, data(rank)["rows"]), "rank 0 sent 0 rows; each rank's rows come back"
        assert torch.equal(result["loss"], torch.arange(float(size))), "equal shapes in the same call stay stacked"
    largest = (size - 1) * 4
    assert [shape for shape, _ in world.calls[0]] == [(_uneven_gather.HEADER_SLOTS,), (largest,), ()]


def test_any_dimension_and_any_number_of_dimensions_may_differ() -> None:
    shapes = [(3, 1), (1, 2, 2)]
    results, _ = _run(2, lambda r: torch.arange(float(torch.Size(shapes[r]).numel())).view(shapes[r]))
    for result in results:
        assert [tuple(t.shape) for t in result] == shapes
        assert torch.equal(result[1], torch.arange(4.0).view(1, 2, 2))


def test_all_empty_tensors_of_different_shapes_send_nothing() -> None:
    results, world = _run(2, lambda r: torch.zeros(0, r + 1, dtype=torch.int32))
    for result in results:
        assert [tuple(t.shape) for t in result] == [(0, 1), (0, 2)]
        assert all(t.dtype == torch.int32 for t in result)
    assert len(world.calls[0]) == 1, "only the header was exchanged"


def test_integer_and_bool_tensors_are_padded_and_cut_back() -> None:
    results, _ = _run(2, lambda r: {"i": torch.arange(r + 1), "b": torch.ones(r + 2, dtype=torch.bool)})
    for result in results:
        assert [t.tolist() for t in result["i"]] == [[0], [0, 1]]
        assert [t.tolist() for t in result["b"]] == [[True, True], [True, True, True]]


def test_many_tensors_take_a_second_larger_header_exchange() -> None:
    count = _uneven_gather.HEADER_SLOTS  # far more slots than the first exchange has
    results, world = _run(2, lambda r: [torch.zeros(r + 1, 2, 2) for _ in range(count)])
    assert len(results[0]) == count and [tuple(t.shape) for t in results[0][0]] == [(1, 2, 2), (2, 2, 2)]
    header_shapes = [shape for shape, _ in world.calls[0][:2]]
    assert header_shapes == [(_uneven_gather.HEADER_SLOTS,), (3 + count * 5,)]


def test_only_one_rank_needing_the_second_exchange_still_brings_everyone() -> None:
    results, _ = _run(2, lambda r: [torch.zeros(2)] * (1 if r == 0 else 200))
    for result in results:
        assert isinstance(result, FabricValueError), "every rank must raise, none may hang"
        assert "tensors per rank: rank 0: 1, rank 1: 200" in str(result)


def test_a_different_number_of_tensors_raises_on_every_rank() -> None:
    results, _ = _run(2, lambda r: [torch.zeros(2)] * (r + 1))
    for result in results:
        assert isinstance(result, FabricValueError)
        assert "do not match (tensors per rank: rank 0: 1, rank 1: 2" in str(result)
        assert "Pass the same structure everywhere" in str(result)


def test_different_keys_raise_on_every_rank() -> None:
    results, _ = _run(2, lambda r: {"a" if r == 0 else "b": torch.zeros(2)})
    for result in results:
        assert isinstance(result, FabricValueError)
        assert "the same keys and the same number of tensors, in the same order" in str(result)


def test_a_tensor_on_one_rank_only_raises_on_every_rank() -> None:
    results, _ = _run(2, lambda r: {"x": torch.zeros(2) if r == 0 else 1.5})
    # A number is a tensor too (converted), so this is the same structure; a None is not.
    assert all(isinstance(result, dict) for result in results)
    results, _ = _run(2, lambda r: {"x": torch.zeros(2) if r == 0 else None})
    for result in results:
        assert isinstance(result, FabricValueError) and "rank 0: 1, rank 1: 0" in str(result)


def test_different_dtypes_raise_on_every_rank() -> None:
    results, _ = _run(2, lambda r: {"x": torch.zeros(2, dtype=torch.float32 if r == 0 else torch.float64)})
    for result in results:
        assert isinstance(result, FabricValueError)
        assert "the tensor at ['x'] has different dtypes on the processes (rank 0: torch.float32, " in str(result)
        assert "rank 1: torch.float64). A gather copies raw elements" in str(result)


def test_the_header_goes_to_the_strategys_root_device() -> None:
    """The nccl path: NCCL gathers only tensors on the GPU, so the header must be made on the root device."""

    class _RecordingStrategy:
        global_rank, world_size = 0, 2
        root_device = torch.device("meta")  # stands in for cuda:N on a machine without a GPU

        def __init__(self) -> None:
            self.devices: list[torch.device] = []

        def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
            self.devices.append(tensor.device)
            raise RuntimeError("stop after the header")

    strategy: Any = _RecordingStrategy()
    with pytest.raises(RuntimeError, match="stop after the header"):
        _uneven_gather.all_gather(strategy, torch.zeros(3), None, False)
    assert strategy.devices == [torch.device("meta")]


def test_one_process_returns_the_data_as_today() -> None:
    class _One:
        global_rank, world_size, root_device = 0, 1, torch.device("cpu")

        def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
            return tensor

    strategy: Any = _One()
    x = torch.zeros(3)
    assert _collectives.all_gather(strategy, {"x": x}, None, False)["x"] is x
