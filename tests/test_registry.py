"""Tests for the registries: a user's accelerator and strategy register and resolve like built-in ones."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from fabric import ACCELERATOR_REGISTRY, STRATEGY_REGISTRY, Accelerator, Fabric, SingleDeviceStrategy
from fabric.registry import Registry


class MyAccelerator(Accelerator):
    """Computes on the CPU, under its own name."""

    name = "myacc"
    set_up: list[torch.device] = []

    @staticmethod
    def is_available() -> bool:
        return True

    @staticmethod
    def auto_device_count() -> int:
        return 1

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        return [0] if devices in ("auto", 1) else list(range(int(devices)))

    @staticmethod
    def get_parallel_devices(indices: list[int]) -> list[torch.device]:
        return [torch.device("cpu")] * len(indices)

    def setup_device(self, device: torch.device) -> None:
        MyAccelerator.set_up.append(device)


class MyStrategy(SingleDeviceStrategy):
    """A single-device strategy that records the modules it sets up."""

    def __init__(self, tag: str = "default", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.tag = tag
        self.modules: list[torch.nn.Module] = []

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        self.modules.append(module)
        return module


@pytest.fixture
def registered() -> Iterator[None]:
    MyAccelerator.set_up.clear()
    try:
        ACCELERATOR_REGISTRY.register("myacc", MyAccelerator, "my hardware")
        STRATEGY_REGISTRY.register("mystrat", MyStrategy, "my strategy", tag="from-registry")
        yield
    finally:
        ACCELERATOR_REGISTRY.remove("myacc")
        STRATEGY_REGISTRY.remove("mystrat")


@pytest.mark.usefixtures("registered")
def test_user_accelerator_and_strategy_by_name() -> None:
    fabric = Fabric(accelerator="myacc", strategy="mystrat")
    assert type(fabric.accelerator) is MyAccelerator
    assert type(fabric.strategy) is MyStrategy
    assert fabric.strategy.tag == "from-registry"  # the registered keyword arguments reach the constructor
    assert fabric.device == torch.device("cpu")
    model = fabric.setup(torch.nn.Linear(2, 2))
    assert fabric.strategy.modules == [model.module]
    assert MyAccelerator.set_up == [torch.device("cpu")]


@pytest.mark.usefixtures("registered")
def test_user_entries_are_listed_in_unknown_name_errors() -> None:
    assert "myacc" in ACCELERATOR_REGISTRY.names()
    assert "mystrat" in STRATEGY_REGISTRY.names()
    with pytest.raises(ValueError, match=r"unknown strategy 'nope'. Choose one of: auto, .*mystrat"):
        Fabric(strategy="nope")
    with pytest.raises(ValueError, match=r"unknown accelerator 'nope'. Choose one of: auto, gpu, .*myacc"):
        Fabric(accelerator="nope")


@pytest.mark.usefixtures("registered")
def test_duplicate_registration_is_refused() -> None:
    with pytest.raises(ValueError, match=r"register\('myacc'\): this accelerator name is already registered"):
        ACCELERATOR_REGISTRY.register("myacc", MyAccelerator)
    with pytest.raises(ValueError, match=r"register\('mystrat'\): this strategy name is already registered"):
        STRATEGY_REGISTRY.register("mystrat", MyStrategy)
    with pytest.raises(ValueError, match=r"register\('ddp'\).*Pick another name or pass override=True"):
        STRATEGY_REGISTRY.register("ddp", MyStrategy)
    assert STRATEGY_REGISTRY.factory_of("mystrat") is MyStrategy


def test_registrations_were_removed() -> None:
    assert "myacc" not in ACCELERATOR_REGISTRY
    assert "mystrat" not in STRATEGY_REGISTRY
    with pytest.raises(ValueError, match=r"unknown strategy 'mystrat'"):
        Fabric(strategy="mystrat")


def test_registry_basics() -> None:
    registry: Registry[Any] = Registry("widget")
    registry.register("a", dict, "first", size=1)
    registry.register("b", list)
    assert registry.names() == ["a", "b"]
    assert list(registry) == ["a", "b"]
    assert "a" in registry and "c" not in registry
    factory, kwargs = registry.get("a")
    assert factory is dict and kwargs == {"size": 1}
    kwargs["size"] = 99  # callers get a copy: the registered defaults do not change
    assert registry.get("a")[1] == {"size": 1}
    registry.register("a", set, override=True)
    assert registry.factory_of("a") is set
    registry.remove("a")
    registry.remove("never-there")  # removing an unknown name is harmless
    assert registry.names() == ["b"]


def test_a_factory_given_by_its_path_is_imported_when_first_asked_for() -> None:
    registry: Registry[Any] = Registry("widget")
    registry.register("od", "collections:OrderedDict", "by path", last=True)
    assert registry.names() == ["od"] and "OD" in registry
    factory, kwargs = registry.get("OD")
    assert factory is collections.OrderedDict and kwargs == {"last": True}
    assert registry.factory_of("od") is collections.OrderedDict


def test_a_bad_factory_path_is_refused_or_explained() -> None:
    registry: Registry[Any] = Registry("widget")
    refused = r"register\(factory='collections.OrderedDict'\): a factory given as text must name a module and an"
    with pytest.raises(ValueError, match=refused + r" attribute in it, as 'package.module:Name'"):
        registry.register("od", "collections.OrderedDict")
    registry.register("gone", "no_such_module_here:Thing")
    registry.register("typo", "collections:OrderDict")
    gone = r"The widget 'gone' is registered as 'no_such_module_here:Thing', which cannot be imported: "
    with pytest.raises(ValueError, match=gone + r"No module named 'no_such_module_here'. Fix the path"):
        registry.get("gone")
    typo = r"The widget 'typo' is registered as 'collections:OrderDict', which cannot be imported: .*OrderDict"
    with pytest.raises(ValueError, match=typo):
        registry.factory_of("typo")


def test_every_registered_strategy_resolves_to_what_its_package_exports() -> None:
    import fabric.strategies as strategies

    for name in STRATEGY_REGISTRY.names():
        factory = STRATEGY_REGISTRY.factory_of(name)
        assert callable(factory), name
        if isinstance(factory, type):
            assert getattr(strategies, factory.__name__) is factory, name
