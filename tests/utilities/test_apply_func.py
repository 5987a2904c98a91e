"""Tests for applying functions over nested collections and moving them between devices."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, defaultdict, namedtuple
from typing import Any

import numpy as np
import pytest
import torch

from fabric.utilities import apply_func
from fabric.utilities.apply_func import apply_to_collection, convert_to_tensors, move_to_device

Point = namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    label: int
    derived: torch.Tensor = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.derived = self.inputs * 2


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    value: torch.Tensor
    name: str


def _double(x: torch.Tensor) -> torch.Tensor:
    return x * 2


def test_single_element_fast_path() -> None:
    assert apply_to_collection(3, int, lambda x, k: x + k, 4) == 7


def test_nested_dict_list_tuple() -> None:
    data: dict[str, Any] = {"a": [torch.tensor(1), (torch.tensor(2), "s")], "b": 1.5}
    out = apply_to_collection(data, torch.Tensor, _double)
    assert out["a"][0].item() == 2
    assert isinstance(out["a"][1], tuple)
    assert out["a"][1][0].item() == 4
    assert out["a"][1][1] == "s"
    assert out["b"] == 1.5
    assert data["a"][0].item() == 1  # the input is not mutated


def test_mapping_types_are_kept() -> None:
    ordered = OrderedDict([("z", 1), ("a", 2)])
    out = apply_to_collection(ordered, int, lambda x: x * 10)
    assert type(out) is OrderedDict
    assert list(out.items()) == [("z", 10), ("a", 20)]

    dd: defaultdict[str, list[int]] = defaultdict(list, {"k": [1]})
    out_dd = apply_to_collection(dd, int, lambda x: x + 1)
    assert type(out_dd) is defaultdict
    assert out_dd.default_factory is list
    assert out_dd["k"] == [2]
    assert out_dd["missing"] == []


def test_namedtuple_is_rebuilt() -> None:
    out = apply_to_collection(Point(1, "y"), int, lambda x: -x)
    assert out == Point(-1, "y")
    assert type(out) is Point


def test_sets_are_left_untouched() -> None:
    data = {1, 2}
    assert apply_to_collection(data, int, lambda x: x + 1) is data


def test_dataclass_with_init_false_field() -> None:
    batch = Batch(torch.tensor([1.0]), label=3)
    out = apply_to_collection(batch, torch.Tensor, _double)
    assert type(out) is Batch
    assert out.inputs.tolist() == [2.0]
    # __post_init__ must not re-run: derived is the transformed original, not recomputed from new inputs.
    assert out.derived.tolist() == [4.0]
    assert out.label == 3
    assert batch.inputs.tolist() == [1.0]


def test_frozen_dataclass() -> None:
    frozen = FrozenBatch(torch.tensor(1.0), "n")
    out = apply_to_collection(frozen, torch.Tensor, _double)
    assert out.value.item() == 2.0
    assert out.name == "n"
    assert frozen.value.item() == 1.0


def test_wrong_dtype_is_skipped() -> None:
    out = apply_to_collection([1, True], int, lambda x: "hit", wrong_dtype=bool)
    assert out == ["hit", True]


def test_include_none_false_drops_from_lists_and_dicts() -> None:
    data = {"keep": 1, "drop": 2, "list": [1, 2]}
    out = apply_to_collection(data, int, lambda x: x if x == 1 else None, include_none=False)
    assert out == {"keep": 1, "list": [1]}
    assert apply_to_collection(Point(1, 2), int, lambda x: None, include_none=False) == Point(1, 2)


def test_move_to_device_keeps_dtype_and_collections() -> None:
    data = {"x": torch.ones(2, dtype=torch.float16), "y": [torch.arange(3)], "z": "text"}
    out = move_to_device(data, "cpu")
    assert out["x"].dtype == torch.float16
    assert out["x"].device == torch.device("cpu")
    assert out["y"][0].dtype == torch.int64
    assert out["z"] == "text"


def test_move_to_device_plain_tensor() -> None:
    tensor = torch.ones(3)
    out = move_to_device(tensor, torch.device("cpu"))
    assert out.device.type == "cpu"
    assert torch.equal(out, tensor)


def test_move_to_device_of_a_list_or_tuple_of_tensors_skips_the_collection_walk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    x, y = torch.ones(2, 3), torch.arange(2)

    def walked(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("(inputs, targets) needs no apply_to_collection")

    with monkeypatch.context() as patch:
        patch.setattr(apply_func, "apply_to_collection", walked)
        as_list, as_tuple = move_to_device([x, y], "cpu"), move_to_device((x, y), "cpu")
    assert type(as_list) is list and type(as_tuple) is tuple
    assert all(a is b for a, b in zip(as_list, (x, y), strict=True)), "already there: the same tensors, no copy"
    assert all(a is b for a, b in zip(as_tuple, (x, y), strict=True))
    # Anything else in the list or tuple takes the general walk, which keeps what it does not move.
    custom = _Custom(returns_self=False)
    mixed = move_to_device([x, 3, custom], "cpu")
    assert mixed[1] == 3 and mixed[2] is custom and custom.calls == [torch.device("cpu")]
    point = move_to_device(Point(x, y), "cpu")
    assert type(point) is Point, "a namedtuple keeps its type"
    param = move_to_device([torch.nn.Parameter(torch.ones(1))], "cpu")
    assert isinstance(param[0], torch.nn.Parameter)


class _Custom:
    def __init__(self, returns_self: bool) -> None:
        self.returns_self = returns_self
        self.calls: list[torch.device] = []

    def to(self, device: torch.device) -> Any:
        self.calls.append(device)
        return self if self.returns_self else None


@pytest.mark.parametrize("returns_self", [True, False])
def test_move_to_device_calls_custom_to(returns_self: bool) -> None:
    custom = _Custom(returns_self)
    out = move_to_device([custom], "cpu")
    assert out[0] is custom
    assert custom.calls == [torch.device("cpu")]


def test_convert_to_tensors() -> None:
    data = {"f": 1.5, "i": 3, "b": True, "arr": np.arange(4)[::-1], "np_int": np.int64(7), "t": torch.ones(2)}
    out = convert_to_tensors(data, torch.device("cpu"))
    assert out["f"].dtype == torch.float32 and out["f"].item() == 1.5
    assert out["i"].dtype == torch.int64 and out["i"].item() == 3
    assert out["b"].dtype == torch.bool
    assert out["arr"].tolist() == [3, 2, 1, 0]
    assert out["np_int"].item() == 7
    assert torch.equal(out["t"], torch.ones(2))


def test_convert_to_tensors_does_not_alias_numpy_input() -> None:
    array = np.zeros(2)
    out = convert_to_tensors(array, torch.device("cpu"))
    out += 1
    assert array.tolist() == [0.0, 0.0]
