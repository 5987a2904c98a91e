"""xla_spmd's flags and arguments: every mistake is refused from Fabric(...) or the constructor, before torch_xla
starts. torch_xla is faked (four virtual CPU devices by PJRT_DEVICE=CPU, CPU_NUM_DEVICES=4), so these run anywhere."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest

from fabric import Fabric
from fabric.strategies import STRATEGY_REGISTRY, XLASPMDStrategy
from fabric.strategies.xla import spmd_mesh


@pytest.fixture
def four_xla_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch_xla 'installed' (never imported by these checks) and four PJRT CPU devices."""
    monkeypatch.setitem(sys.modules, "torch_xla", types.ModuleType("torch_xla"))
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")


def test_registered_by_name() -> None:
    assert STRATEGY_REGISTRY.factory_of("xla_spmd") is XLASPMDStrategy


@pytest.mark.usefixtures("four_xla_devices")
def test_default_mesh_puts_every_device_on_fsdp() -> None:
    fabric = Fabric(accelerator="xla", strategy="xla_spmd")
    strategy = fabric.strategy
    assert isinstance(strategy, XLASPMDStrategy)
    assert (strategy.mesh_shape, strategy.axis_names) == ((4, 1), ("fsdp", "model"))
    assert (fabric.world_size, fabric.global_rank, fabric.device.type) == (1, 0, "xla")


@pytest.mark.usefixtures("four_xla_devices")
@pytest.mark.parametrize(
    ("mesh_shape", "axis_names", "expected"),
    [((-1, 2), None, ((2, 2), ("fsdp", "model"))), ((1, 2, 2), None, ((1, 2, 2), ("data", "fsdp", "model"))),
     ((4,), ("data",), ((4,), ("data",))), (None, ("data", "model"), ((4, 1), ("data", "model")))],
)  # fmt: skip
def test_mesh_shapes_and_names(mesh_shape: tuple | None, axis_names: tuple | None, expected: tuple) -> None:
    strategy = XLASPMDStrategy(mesh_shape=mesh_shape, axis_names=axis_names)
    Fabric(accelerator="tpu", strategy=strategy)
    assert (strategy.mesh_shape, strategy.axis_names) == expected


@pytest.mark.usefixtures("four_xla_devices")
@pytest.mark.parametrize("mesh_shape", [(3, 1), (2, 4), (-1, 3)])
def test_mesh_whose_product_is_not_the_device_count(mesh_shape: tuple) -> None:
    with pytest.raises(ValueError, match=r"but this host has 4 XLA devices.*Choose sizes whose product is 4"):
        Fabric(accelerator="xla", strategy=XLASPMDStrategy(mesh_shape=mesh_shape))


@pytest.mark.parametrize("mesh_shape", [(0, 4), (-1, -1), "4,1", (2.0, 2), ()])
def test_mesh_shape_that_is_not_sizes(mesh_shape: object) -> None:
    with pytest.raises(ValueError, match=r"expected a tuple of positive device counts"):
        XLASPMDStrategy(mesh_shape=mesh_shape)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"axis_names": ("batch", "tensor")}, r"each axis must be one of data, fsdp, model"),
     ({"axis_names": ("fsdp", "fsdp")}, r"each axis must be one of data, fsdp, model, named once"),
     ({"mesh_shape": (2, 2), "axis_names": ("fsdp",)}, r"2 sizes but 1 names"),
     ({"mesh_shape": (1, 1, 2, 2)}, r"a mesh has at most 3 axes"),
     ({"axis_names": "fsdp"}, r"expected a tuple of axis names")],
)  # fmt: skip
def test_bad_axis_names(kwargs: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        XLASPMDStrategy(**kwargs)


def test_plan_with_an_axis_the_mesh_lacks() -> None:
    with pytest.raises(ValueError, match=r"axis 'tensor' is not an axis of the mesh \('fsdp', 'model'\)"):
        XLASPMDStrategy(sharding_plan={"*.weight": ("tensor", None)})
    with pytest.raises(ValueError, match=r"axis 'data' is not an axis of the mesh"):
        XLASPMDStrategy(sharding_plan={"*.weight": (("data", "fsdp"), None)})


@pytest.mark.parametrize(
    ("plan", "error", "message"),
    [(["w"], TypeError, r"expected a dict from parameter-name patterns to partition specs"),
     ({"w": "model"}, TypeError, r"each entry maps a name pattern \(str\) to a tuple"),
     ({"w": (1, None)}, TypeError, r"1 is not a mesh axis"),
     ({"w": ("model", "model")}, ValueError, r"a mesh axis is used for two dimensions")],
)  # fmt: skip
def test_malformed_plan(plan: object, error: type, message: str) -> None:
    with pytest.raises(error, match=message):
        XLASPMDStrategy(sharding_plan=plan)  # type: ignore[arg-type]


def test_plan_matching_is_checked_against_the_parameters() -> None:
    import torch

    params = [("layer.q.weight", torch.zeros(4, 4)), ("layer.q.bias", torch.zeros(4))]
    plan = {"*.q.weight": ("model", None)}
    assert spmd_mesh.match_plan(plan, params, "S") == {"layer.q.weight": ("model", None)}
    with pytest.raises(ValueError, match=r"matches no parameter of the model \(its parameters are named like"):
        spmd_mesh.match_plan({"*.k.weight": ("model", None)}, params, "S")
    with pytest.raises(ValueError, match=r"'layer.q.weight' matches both 'layer.\*' and '\*.weight'"):
        spmd_mesh.match_plan({"layer.*": ("model", None), "*.weight": (None, "model")}, params[:1], "S")


def test_batch_spec_splits_dimension_zero_along_the_batch_axes() -> None:
    assert spmd_mesh.batch_spec(("fsdp", "model"), 2) == ("fsdp", None)
    assert spmd_mesh.batch_spec(("data", "fsdp", "model"), 1) == (("data", "fsdp"),)
    assert spmd_mesh.batch_spec(("model",), 2) is None
    assert spmd_mesh.batch_spec(("fsdp",), 0) is None


@pytest.mark.usefixtures("four_xla_devices")
def test_fewer_devices_than_the_host_has() -> None:
    with pytest.raises(ValueError, match=r"devices=1\): xla_spmd shards over every device of this host, which has 4"):
        Fabric(accelerator="xla", strategy="xla_spmd", devices=1)


@pytest.mark.usefixtures("four_xla_devices")
def test_several_nodes() -> None:
    with pytest.raises(ValueError, match=r"num_nodes=2\): this strategy drives the devices of one host"):
        Fabric(accelerator="xla", strategy="xla_spmd", num_nodes=2)


@pytest.mark.usefixtures("four_xla_devices")
def test_non_xla_accelerator() -> None:
    with pytest.raises(ValueError, match=r"xla_spmd runs on XLA devices only. Pass accelerator='tpu'"):
        Fabric(accelerator="cpu", strategy="xla_spmd")


def test_without_torch_xla(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch_xla", None)
    with pytest.raises(ModuleNotFoundError, match=r"strategy='xla_spmd'\): torch_xla is not installed"):
        Fabric(accelerator="cpu", strategy="xla_spmd")


def test_unknown_state_dict_type() -> None:
    with pytest.raises(ValueError, match=r"state_dict_type='consolidated'\): unknown checkpoint layout"):
        XLASPMDStrategy(state_dict_type="consolidated")


@pytest.mark.usefixtures("four_xla_devices")
def test_mesh_before_launch_is_explained() -> None:
    fabric = Fabric(accelerator="xla", strategy="xla_spmd")
    with pytest.raises(RuntimeError, match=r"the mesh is built when the process is set up"):
        fabric.strategy.mesh  # type: ignore[attr-defined]  # noqa: B018


@pytest.mark.usefixtures("four_xla_devices")
def test_precision_is_xla_precision_and_refuses_what_xla_cannot_do() -> None:
    from fabric.precision import MixedPrecision, XLAPrecision

    fabric = Fabric(accelerator="xla", strategy="xla_spmd", precision="bf16-mixed")
    assert isinstance(fabric.strategy.precision, XLAPrecision)
    assert fabric.strategy.precision.precision == "bf16-mixed"
    with pytest.raises(ValueError, match=r"precision='16-mixed'\): float16 autocast needs loss scaling"):
        Fabric(accelerator="xla", strategy="xla_spmd", precision="16-mixed")
    with pytest.raises(TypeError, match=r"plugins=\[MixedPrecision\]\): the XLA strategies need XLAPrecision"):
        Fabric(accelerator="xla", strategy="xla_spmd", plugins=[MixedPrecision("bf16-mixed", device="xla")])


@pytest.mark.usefixtures("four_xla_devices")
def test_sharded_saves_refuse_storage_options_and_background_writing(tmp_path: Path) -> None:
    from fabric.io import AsyncCheckpointIO

    fabric = Fabric(accelerator="xla", strategy="xla_spmd")
    with pytest.raises(TypeError, match=r"checkpoints of xla_spmd take no storage options"):
        fabric.strategy.save_checkpoint(tmp_path / "ckpt", {"step": 1}, storage_options={"mode": "x"})
    fabric = Fabric(accelerator="xla", strategy="xla_spmd", plugins=[AsyncCheckpointIO()])
    with pytest.raises(ValueError, match=r"with AsyncCheckpointIO: sharded xla_spmd checkpoints are written synchr"):
        fabric.strategy.save_checkpoint(tmp_path / "ckpt", {"step": 1})
    assert not (tmp_path / "ckpt").exists()
