"""Tests for the connector: how Fabric(...) flags and the environment become one fully built strategy."""

from __future__ import annotations

import re
import warnings
from typing import Any

import pytest
import torch

from fabric import (
    CPUAccelerator,
    CUDAAccelerator,
    DDPStrategy,
    DefaultEnvironment,
    DoublePrecision,
    Fabric,
    HalfPrecision,
    MixedPrecision,
    Precision,
    SingleDeviceStrategy,
    TorchCheckpointIO,
    TorchElasticEnvironment,
)
from fabric._connector import PRECISIONS
from fabric.accelerators import ACCELERATOR_REGISTRY
from fabric.strategies import STRATEGY_REGISTRY
from fabric.strategies.launchers.multiprocessing import MultiProcessingLauncher
from fabric.strategies.launchers.subprocess_script import SubprocessScriptLauncher

pytestmark = pytest.mark.usefixtures("no_cluster_env")


def _torchrun_env(monkeypatch: pytest.MonkeyPatch, **overrides: str) -> None:
    """What torchrun sets in rank 3 of 2 nodes x 2 processes."""
    values = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29501",
    }
    values.update(overrides)
    for name, value in values.items():
        monkeypatch.setenv(name, value)


# -- defaults and strategy names ----------------------------------------------------------------------
def test_defaults_give_single_device_strategy_on_cpu() -> None:
    fabric = Fabric()
    strategy = fabric.strategy
    assert type(strategy) is SingleDeviceStrategy
    assert isinstance(strategy.accelerator, CPUAccelerator)
    assert strategy.root_device == torch.device("cpu")
    assert type(strategy.precision) is Precision
    assert strategy.precision.precision == "32-true"
    assert isinstance(strategy.checkpoint_io, TorchCheckpointIO)
    assert strategy.launcher is None
    assert strategy.world_size == 1


def test_two_cpu_devices_give_ddp_with_script_launcher() -> None:
    fabric = Fabric(accelerator="cpu", devices=2)
    strategy = fabric.strategy
    assert type(strategy) is DDPStrategy
    assert strategy.world_size == 2
    assert strategy.num_processes == 2
    assert strategy.parallel_devices == [torch.device("cpu")] * 2
    assert isinstance(strategy.cluster_environment, DefaultEnvironment)
    launcher = strategy.launcher
    assert isinstance(launcher, SubprocessScriptLauncher)
    assert launcher.num_processes == 2
    assert launcher.num_nodes == 1
    assert launcher.continues_script
    assert strategy.process_group_backend == "gloo"


def test_devices_and_num_nodes_multiply_into_world_size() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=3)
    assert fabric.world_size == 6
    assert fabric.strategy.launcher.num_nodes == 3


def test_auto_strategy_with_one_device_on_many_nodes_is_ddp() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, num_nodes=2)
    assert type(fabric.strategy) is DDPStrategy
    assert fabric.world_size == 2


@pytest.mark.parametrize(
    ("name", "start_method"),
    [("ddp_spawn", "spawn"), ("ddp_fork", "fork"), ("ddp_notebook", "fork")],
)
def test_multiprocessing_strategies_get_their_start_method(name: str, start_method: str) -> None:
    fabric = Fabric(accelerator="cpu", strategy=name, devices=2)
    launcher = fabric.strategy.launcher
    assert type(fabric.strategy) is DDPStrategy
    assert isinstance(launcher, MultiProcessingLauncher)
    assert launcher.start_method == start_method
    assert launcher.num_processes == 2
    assert not launcher.continues_script
    assert launcher.is_interactive_compatible is (start_method == "fork")


@pytest.mark.parametrize(
    ("name", "expected"),
    [("ddp_find_unused_parameters_true", True), ("ddp_find_unused_parameters_false", False)],
)
def test_find_unused_parameters_reaches_ddp_kwargs(name: str, expected: bool) -> None:
    fabric = Fabric(accelerator="cpu", strategy=name, devices=2)
    assert fabric.strategy._ddp_kwargs == {"find_unused_parameters": expected}
    assert isinstance(fabric.strategy.launcher, SubprocessScriptLauncher)


def test_spawn_variant_of_find_unused_parameters_keeps_spawn() -> None:
    fabric = Fabric(accelerator="cpu", strategy="ddp_spawn_find_unused_parameters_true", devices=2)
    assert fabric.strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert fabric.strategy.launcher.start_method == "spawn"


def test_user_strategy_instance_is_completed() -> None:
    strategy = DDPStrategy(process_group_backend="gloo")
    fabric = Fabric(accelerator="cpu", strategy=strategy, devices=2)
    assert fabric.strategy is strategy
    assert isinstance(strategy.accelerator, CPUAccelerator)
    assert type(strategy.precision) is Precision
    assert isinstance(strategy.cluster_environment, DefaultEnvironment)
    assert isinstance(strategy.checkpoint_io, TorchCheckpointIO)
    assert strategy.process_group_backend == "gloo"
    assert strategy.world_size == 2
    assert isinstance(strategy.launcher, SubprocessScriptLauncher)


def test_user_strategy_keeps_its_own_components() -> None:
    accelerator = CPUAccelerator()
    precision = DoublePrecision()
    environment = DefaultEnvironment()
    strategy = DDPStrategy(accelerator=accelerator, precision=precision, cluster_environment=environment)
    fabric = Fabric(strategy=strategy, devices=2)
    assert fabric.accelerator is accelerator
    assert fabric.strategy.precision is precision
    assert fabric.strategy.cluster_environment is environment


def test_user_single_device_strategy_with_named_device() -> None:
    strategy = SingleDeviceStrategy(device="cpu")
    fabric = Fabric(strategy=strategy)
    assert fabric.strategy is strategy
    assert fabric.device == torch.device("cpu")
    assert isinstance(fabric.accelerator, CPUAccelerator)


def test_plugins_are_handed_to_the_strategy() -> None:
    class MyIO(TorchCheckpointIO):
        pass

    io, env, precision = MyIO(), DefaultEnvironment(), DoublePrecision()
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2, plugins=[io, env, precision])
    assert fabric.strategy.checkpoint_io is io
    assert fabric.strategy.cluster_environment is env
    assert fabric.strategy.precision is precision


def test_a_single_plugin_need_not_be_in_a_list() -> None:
    precision = HalfPrecision("bf16-true")
    fabric = Fabric(plugins=precision)
    assert fabric.strategy.precision is precision


def test_accelerator_instance_is_used() -> None:
    accelerator = CPUAccelerator()
    fabric = Fabric(accelerator=accelerator)
    assert fabric.accelerator is accelerator


# -- precision ---------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("flag", "cls", "name"),
    [
        (None, Precision, "32-true"),
        ("32-true", Precision, "32-true"),
        (32, Precision, "32-true"),
        ("32", Precision, "32-true"),
        ("64-true", DoublePrecision, "64-true"),
        (64, DoublePrecision, "64-true"),
        ("64", DoublePrecision, "64-true"),
        ("bf16-mixed", MixedPrecision, "bf16-mixed"),
        ("bf16", MixedPrecision, "bf16-mixed"),
        ("16-true", HalfPrecision, "16-true"),
        ("bf16-true", HalfPrecision, "bf16-true"),
    ],
)
def test_precision_flag_gives_plugin(flag: Any, cls: type, name: str) -> None:
    precision = Fabric(accelerator="cpu", precision=flag).strategy.precision
    assert type(precision) is cls
    assert precision.precision == name


def test_bf16_mixed_on_cpu_autocasts_on_cpu_without_scaler() -> None:
    precision = Fabric(accelerator="cpu", precision="bf16-mixed").strategy.precision
    assert isinstance(precision, MixedPrecision)
    assert precision.device == "cpu"
    assert precision.scaler is None


@pytest.mark.parametrize("flag", ["16-mixed", 16, "16"])
def test_16_mixed_on_cpu_warns_and_falls_back_to_bf16(flag: Any) -> None:
    with pytest.warns(UserWarning, match=r"float16 mixed precision is not supported on the CPU; using 'bf16-mixed'"):
        fabric = Fabric(accelerator="cpu", precision=flag)
    precision = fabric.strategy.precision
    assert isinstance(precision, MixedPrecision)
    assert precision.precision == "bf16-mixed"
    assert precision.scaler is None


@pytest.mark.parametrize("name", PRECISIONS)
def test_every_documented_precision_string_builds(name: str) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        precision = Fabric(accelerator="cpu", precision=name).strategy.precision
    # 16-mixed is the only one that changes (and says so) on the CPU.
    expected = "bf16-mixed" if name == "16-mixed" else name
    assert precision.precision == expected
    assert len(caught) == (1 if name == "16-mixed" else 0)


# -- flag errors ---------------------------------------------------------------------------------------
def test_unknown_accelerator_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"Fabric\(accelerator='qpu'\): unknown accelerator 'qpu'") as err:
        Fabric(accelerator="qpu")
    for name in ("auto", "gpu", *ACCELERATOR_REGISTRY.names()):
        assert name in str(err.value)
    assert "pass an Accelerator instance" in str(err.value)


def test_accelerator_of_wrong_type() -> None:
    with pytest.raises(TypeError, match=r"Fabric\(accelerator=3\): expected a name or an Accelerator instance"):
        Fabric(accelerator=3)  # type: ignore[arg-type]


def test_unknown_strategy_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"Fabric\(strategy='ddp_spwan'\): unknown strategy 'ddp_spwan'") as err:
        Fabric(strategy="ddp_spwan")
    for name in ("auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook", "single_device"):
        assert name in str(err.value)
    assert "pass a Strategy instance" in str(err.value)


@pytest.mark.parametrize("flag", [5, DDPStrategy, object()])
def test_strategy_of_wrong_type(flag: Any) -> None:
    with pytest.raises(TypeError, match=r"expected a strategy name or a Strategy instance. Pass e.g. 'ddp'"):
        Fabric(strategy=flag)


def test_unknown_precision_lists_choices() -> None:
    with pytest.raises(ValueError, match=r"Fabric\(precision='8-true'\): unknown precision '8-true'") as err:
        Fabric(precision="8-true")
    for name in PRECISIONS:
        assert name in str(err.value)
    assert "legacy 32, 64, 16, 'bf16'" in str(err.value)


def test_unhashable_precision_gets_the_unknown_precision_message() -> None:
    with pytest.raises(ValueError, match=r"unknown precision"):
        Fabric(precision=["bf16"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("devices", "why"),
    [
        (0, "the number of CPU processes must be positive"),
        (-2, "the number of CPU processes must be positive"),
        ("0", "the number of CPU processes must be positive"),
        (True, "on the CPU, devices is the number of processes"),
        (1.5, "on the CPU, devices is the number of processes"),
        ([0, 1], "on the CPU, devices is the number of processes"),
        ("two", "on the CPU, devices is the number of processes"),
    ],
)
def test_bad_devices_on_cpu(devices: Any, why: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"Fabric(devices={devices!r}): {why}")):
        Fabric(accelerator="cpu", devices=devices)


def test_cuda_is_not_available_here() -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match=r"Fabric\(accelerator='cuda'\): CUDAAccelerator is not available"):
        Fabric(accelerator="cuda")


def test_gpu_without_any_gpu() -> None:
    if torch.cuda.is_available() or torch.backends.mps.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match=r"Fabric\(accelerator='gpu'\): no GPU \(CUDA or MPS\) is available"):
        Fabric(accelerator="gpu")


def test_precision_flag_and_precision_plugin_conflict() -> None:
    with pytest.raises(
        ValueError, match=r"Fabric\(precision='64-true', plugins=\[DoublePrecision\]\): both set the precision"
    ):
        Fabric(precision="64-true", plugins=[DoublePrecision()])


def test_two_cluster_environments_conflict() -> None:
    strategy = DDPStrategy(cluster_environment=DefaultEnvironment())
    with pytest.raises(ValueError, match=r"two cluster environments were given. Pass only one"):
        Fabric(accelerator="cpu", strategy=strategy, devices=2, plugins=[DefaultEnvironment()])


def test_same_cluster_environment_twice_is_fine() -> None:
    env = DefaultEnvironment()
    fabric = Fabric(accelerator="cpu", strategy=DDPStrategy(cluster_environment=env), devices=2, plugins=[env])
    assert fabric.strategy.cluster_environment is env


@pytest.mark.parametrize(
    ("plugins", "role", "names"),
    [
        ([DoublePrecision(), HalfPrecision()], "Precision", "DoublePrecision, HalfPrecision"),
        ([TorchCheckpointIO(), TorchCheckpointIO()], "CheckpointIO", "TorchCheckpointIO, TorchCheckpointIO"),
        ([DefaultEnvironment(), TorchElasticEnvironment()], "ClusterEnvironment", "DefaultEnvironment, "),
    ],
)
def test_two_plugins_of_one_role(plugins: list[Any], role: str, names: str) -> None:
    with pytest.raises(ValueError, match=rf"Fabric\(plugins=\[{names}.*two {role} plugins were passed"):
        Fabric(plugins=plugins)


@pytest.mark.parametrize("plugin", ["bf16", CPUAccelerator()])
def test_unknown_plugin_type(plugin: Any) -> None:
    name = type(plugin).__name__
    with pytest.raises(TypeError, match=rf"Fabric\(plugins=\[{name}\]\): not a plugin fabric knows"):
        Fabric(plugins=[plugin])


def test_strategy_accelerator_disagrees_with_flag() -> None:
    strategy = DDPStrategy(accelerator=CPUAccelerator())
    with pytest.raises(
        ValueError,
        match=r"Fabric\(accelerator='cuda', strategy=DDPStrategy\(accelerator=CPUAccelerator\(\)\)\): "
        r"the strategy's accelerator disagrees",
    ):
        Fabric(accelerator="cuda", strategy=strategy)


def test_strategy_accelerator_agreeing_with_flag_is_fine() -> None:
    accelerator = CPUAccelerator()
    fabric = Fabric(accelerator="cpu", strategy=SingleDeviceStrategy(accelerator=accelerator))
    assert fabric.accelerator is accelerator


@pytest.mark.parametrize(
    "kwargs",
    [{"precision": "32-true"}, {"plugins": [HalfPrecision()]}],
)
def test_strategy_precision_and_precision_flag_conflict(kwargs: dict[str, Any]) -> None:
    strategy = SingleDeviceStrategy(precision=DoublePrecision())
    with pytest.raises(
        ValueError,
        match=r"strategy=SingleDeviceStrategy\(precision=DoublePrecision\)\): the precision is set twice",
    ):
        Fabric(strategy=strategy, **kwargs)


@pytest.mark.parametrize("num_nodes", [0, -1, True, 1.0, "2"])
def test_bad_num_nodes(num_nodes: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"Fabric(num_nodes={num_nodes!r}): the number of machines")):
        Fabric(num_nodes=num_nodes)


@pytest.mark.parametrize(("devices", "num_nodes", "total"), [(2, 1, 2), (1, 2, 2)])
def test_single_device_strategy_on_many_devices(devices: int, num_nodes: int, total: int) -> None:
    with pytest.raises(ValueError, match=rf"a single-device strategy cannot run on {total} devices"):
        Fabric(accelerator="cpu", strategy="single_device", devices=devices, num_nodes=num_nodes)


def test_user_single_device_strategy_on_two_devices() -> None:
    with pytest.raises(ValueError, match=r"devices=2, num_nodes=1\): a single-device strategy cannot run on 2"):
        Fabric(accelerator="cpu", strategy=SingleDeviceStrategy(), devices=2)


def test_single_device_strategy_error_names_the_strategy_class() -> None:
    with pytest.raises(ValueError, match=r"^Fabric\(strategy=SingleDeviceStrategy[(,]"):
        Fabric(accelerator="cpu", strategy=SingleDeviceStrategy(), devices=2)


@pytest.mark.parametrize("strategy", ["single_device", "object"])
def test_single_device_strategy_runs_alone_under_torchrun(monkeypatch: pytest.MonkeyPatch, strategy: str) -> None:
    # As in Lightning Fabric (sheeprl builds its player Fabric so): one process on one device, rank 0 of 1, whatever
    # the launcher started; devices='auto' means that one device, not the launcher's processes.
    _torchrun_env(monkeypatch)
    chosen = SingleDeviceStrategy(device="cpu") if strategy == "object" else strategy
    fabric = Fabric(accelerator="cpu", strategy=chosen)
    assert type(fabric.strategy) is SingleDeviceStrategy
    assert (fabric.world_size, fabric.global_rank, fabric.local_rank, fabric.node_rank) == (1, 0, 0, 0)
    assert fabric.strategy.launcher is None and fabric.device == torch.device("cpu")
    assert fabric.all_reduce(torch.tensor(2.0), reduce_op="sum").item() == 2.0


# -- processes started by torchrun ---------------------------------------------------------------------
def test_torchrun_env_is_detected_and_used(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch)
    fabric = Fabric(accelerator="cpu", num_nodes=2)
    strategy = fabric.strategy
    assert isinstance(strategy.cluster_environment, TorchElasticEnvironment)
    assert type(strategy) is DDPStrategy
    assert strategy.num_processes == 2  # devices="auto" -> LOCAL_WORLD_SIZE
    assert strategy.launcher is None  # torchrun already started every process
    assert fabric.global_rank == 3
    assert fabric.local_rank == 1
    assert fabric.node_rank == 1
    assert fabric.world_size == 4
    assert not fabric.is_global_zero
    assert strategy.cluster_environment.main_address == "10.0.0.1"
    assert strategy.cluster_environment.main_port == 29501


def test_torchrun_with_matching_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch)
    fabric = Fabric(accelerator="cpu", devices=2, num_nodes=2)
    assert fabric.world_size == 4
    assert fabric.strategy.launcher is None


def test_torchrun_single_process_is_single_device(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", GROUP_RANK="0")
    fabric = Fabric(accelerator="cpu")
    assert type(fabric.strategy) is SingleDeviceStrategy
    assert fabric.world_size == 1


def test_torchrun_with_mismatched_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch)
    with pytest.raises(
        ValueError,
        match=r"Fabric\(devices=3\): torchrun started 2 processes on this machine "
        r"\(LOCAL_WORLD_SIZE=2\)\. Pass devices=2",
    ):
        Fabric(accelerator="cpu", devices=3, num_nodes=2)


def test_torchrun_with_mismatched_num_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    _torchrun_env(monkeypatch)
    with pytest.raises(
        ValueError,
        match=r"Fabric\(devices=2, num_nodes=1\): torchrun started WORLD_SIZE=4 processes, not 2 x 1\. "
        r"Pass num_nodes=2",
    ):
        Fabric(accelerator="cpu", num_nodes=1)


def test_torchrun_with_cpu_accelerator_subclass(monkeypatch: pytest.MonkeyPatch) -> None:
    class MyCPU(CPUAccelerator):
        pass

    _torchrun_env(monkeypatch)
    fabric = Fabric(accelerator=MyCPU(), num_nodes=2)
    assert fabric.world_size == 4


def test_launcher_started_child_reads_local_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    # What fabric's own script launcher sets in the child with local rank 1.
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("NODE_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29400")
    fabric = Fabric(accelerator="cpu", devices=2)
    assert isinstance(fabric.strategy.cluster_environment, DefaultEnvironment)
    assert fabric.strategy.launcher is None
    assert fabric.global_rank == 1
    assert fabric.local_rank == 1
    assert fabric.strategy.cluster_environment.main_port == 29400


def test_registry_holds_the_documented_strategies() -> None:
    for name in ("single_device", "ddp", "ddp_spawn", "ddp_fork", "ddp_notebook"):
        assert name in STRATEGY_REGISTRY
    assert ACCELERATOR_REGISTRY.factory_of("cuda") is CUDAAccelerator
