"""FSDPStrategy without extra processes: registry names, precision mapping, options, errors, and a 1-process world.

The 2-process training checks (parity with DDP, clipping, accumulation, meta init) are in
tests/integration/test_fsdp.py.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest
import torch
from _one_process import one_process
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from fabric import Fabric, MixedPrecision, Precision
from fabric.precision.fsdp import FSDPPrecision, as_fsdp_precision
from fabric.strategies import STRATEGY_REGISTRY, FSDPStrategy
from fabric.strategies.fsdp import utils
from fabric.strategies.launchers.subprocess_script import SubprocessScriptLauncher

pytestmark = pytest.mark.usefixtures("no_cluster_env")


class _CustomPrecision(Precision):
    precision = "transformer-engine"


def _fabric(**kwargs: object) -> Fabric:
    kwargs.setdefault("devices", 2)
    return Fabric(accelerator="cpu", **kwargs)  # type: ignore[arg-type]


# -- registry and construction -------------------------------------------------------------------------
def test_registry_names_build_fsdp_with_the_script_launcher() -> None:
    assert "fsdp" in STRATEGY_REGISTRY and "fsdp_cpu_offload" in STRATEGY_REGISTRY
    plain, offload = _fabric(strategy="fsdp").strategy, _fabric(strategy="fsdp_cpu_offload").strategy
    assert isinstance(plain, FSDPStrategy) and isinstance(offload, FSDPStrategy)
    assert not plain.cpu_offload and offload.cpu_offload
    assert isinstance(plain.launcher, SubprocessScriptLauncher)
    assert plain.world_size == 2 and plain.state_dict_type == "sharded"


@pytest.mark.parametrize(
    ("precision", "param_dtype"),
    [("bf16-mixed", torch.bfloat16), ("32-true", None), ("64-true", None), ("bf16-true", None), ("16-true", None)],
)
def test_precision_maps_to_a_mixed_precision_policy(precision: str, param_dtype: torch.dtype | None) -> None:
    policy = _fabric(strategy="fsdp", precision=precision).strategy.mixed_precision_policy  # type: ignore[attr-defined]
    if param_dtype is None:
        assert policy is None  # the precision plugin casts the whole module before it is sharded
    else:
        assert policy == MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def test_16_mixed_computes_in_float16_and_reduces_in_float32() -> None:
    from fabric.precision.fsdp import mixed_precision_policy

    # what fully_shard gets (the plugin's mixed_precision_config follows Lightning's table instead)
    policy = mixed_precision_policy(FSDPPrecision("16-mixed", device="cpu").precision)
    assert policy == MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float32)


def test_explicit_policy_overrides_the_precision_flag() -> None:
    explicit = MixedPrecisionPolicy(param_dtype=torch.float16, reduce_dtype=torch.float16)
    strategy = _fabric(strategy=FSDPStrategy(mixed_precision=explicit), precision="bf16-mixed").strategy
    assert strategy.mixed_precision_policy is explicit  # type: ignore[attr-defined]


def test_float16_loss_scaler_becomes_the_sharded_one() -> None:
    # Without a GPU, torch 2.13's scaler warns "CUDA is not available" and disables itself; torch 2.9's CUDA build
    # stays silent. Either way the plugin must swap in the sharded scaler.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        swapped = as_fsdp_precision(MixedPrecision("16-mixed", device="cuda"), "FSDPStrategy")
    assert isinstance(swapped, FSDPPrecision) and isinstance(swapped.scaler, ShardedGradScaler)
    plain = as_fsdp_precision(Precision(), "FSDPStrategy")
    assert isinstance(plain, FSDPPrecision) and plain.precision == "32-true" and plain.scaler is None


def test_precision_fsdp_cannot_honour_fails_when_fabric_is_built() -> None:
    with pytest.raises(ValueError, match=r"FSDPStrategy\(precision=_CustomPrecision with precision='transformer-"):
        _fabric(strategy="fsdp", plugins=[_CustomPrecision()])
    with pytest.raises(ValueError, match="sharded parameters only support the policies 32-true"):
        FSDPStrategy(precision=_CustomPrecision())


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"state_dict_type": "local"}, ValueError, r"state_dict_type='local'\): unknown checkpoint layout"),
        ({"sharding_strategy": "NO_SHARD"}, ValueError, r"not supported by fully_shard.*use strategy='ddp'"),
        ({"auto_wrap_policy": {"Linear"}}, TypeError, r"auto_wrap_policy=\{'Linear'\}\): expected a set of layer"),
        ({"activation_checkpointing_policy": nn.Linear}, TypeError, "activation_checkpointing_policy=<class"),
        ({"device_mesh": (2, 0)}, TypeError, r"device_mesh=\(2, 0\)\): expected a DeviceMesh or a \(replicas"),
        ({"start_method": "thread"}, ValueError, r"start_method='thread'\): unknown start method"),
    ],
)
def test_bad_options_are_named(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        FSDPStrategy(**kwargs)


def test_policies_accept_classes_or_functions() -> None:
    strategy = FSDPStrategy(auto_wrap_policy={nn.Linear}, activation_checkpointing_policy=lambda m: False)
    assert strategy._auto_wrap_policy is not None and strategy._auto_wrap_policy(nn.Linear(1, 1))
    assert not strategy._auto_wrap_policy(nn.ReLU())


def test_mesh_sizes_must_cover_the_processes() -> None:
    with pytest.raises(ValueError, match=r"device_mesh=\(2, 2\)\): 2 replicas x 2 shards = 4 processes, but this"):
        _fabric(strategy=FSDPStrategy(device_mesh=(2, 2)))


def test_device_mesh_exists_only_after_launch() -> None:
    with pytest.raises(RuntimeError, match=r"FSDPStrategy.device_mesh: the mesh is built when the process group"):
        _ = _fabric(strategy="fsdp").strategy.device_mesh  # type: ignore[attr-defined]


def test_empty_init_creates_parameters_on_the_meta_device() -> None:
    strategy = _fabric(strategy="fsdp", precision="bf16-true").strategy
    with strategy.module_init_context(empty_init=True):
        meta = nn.Linear(4, 4)
    with strategy.module_init_context(empty_init=False):
        real = nn.Linear(4, 4)
    assert meta.weight.is_meta and meta.weight.dtype == torch.bfloat16
    assert real.weight.device.type == "cpu" and real.weight.dtype == torch.bfloat16


def test_checkpoint_storage_options_are_refused() -> None:
    with pytest.raises(TypeError, match=r"save_checkpoint\(storage_options=...\): sharded checkpoints are written"):
        FSDPStrategy().save_checkpoint("unused", {}, storage_options={"compress": True})


# -- helpers on plain tensors ----------------------------------------------------------------------------
def test_clip_norm_of_regular_tensors_matches_torch() -> None:
    torch.manual_seed(0)
    ours, theirs = nn.Linear(8, 8), nn.Linear(8, 8)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(4, 8)
    for model in (ours, theirs):
        model(x).pow(2).sum().backward()
    norm = utils.clip_grad_norm(ours.parameters(), 0.1, 2.0, error_if_nonfinite=True)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 0.1)
    torch.testing.assert_close(norm, expected)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_clip_non_finite_norm_is_named() -> None:
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.tensor([float("inf"), 1.0])
    with pytest.raises(RuntimeError, match=r"clip_gradients\(max_norm=1.0\): the total gradient norm is inf"):
        utils.clip_grad_norm([param], 1.0, 2.0, error_if_nonfinite=True)
    assert torch.isinf(utils.clip_grad_norm([param], 1.0, 2.0, error_if_nonfinite=False))


# -- a 1-process world: real fully_shard, real errors ------------------------------------------------------
@pytest.fixture
def fabric1() -> Iterator[Fabric]:
    yield from one_process("fsdp")


def test_one_process_trains_with_sharded_parameters(fabric1: Fabric) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric1.setup(model, optimizer)
    assert {type(p).__name__ for p in model.parameters()} == {"DTensor"}
    assert all(p is q for p, q in zip(optimizer.param_groups[0]["params"], model.module.parameters(), strict=True))
    before = [p.full_tensor().clone() for p in model.parameters()]
    fabric1.backward(model(torch.randn(3, 4)).sum())
    fabric1.clip_gradients(model, optimizer, clip_val=1e-3)
    assert all(p.grad.full_tensor().abs().max() <= 1e-3 for p in model.parameters())
    optimizer.step()
    assert any(not torch.equal(b, p.full_tensor()) for b, p in zip(before, model.parameters(), strict=True))


def test_module_without_parameters_is_refused(fabric1: Fabric) -> None:
    with pytest.raises(ValueError, match=r"FSDPStrategy.setup_module\(ReLU\): the module has no parameters, so"):
        fabric1.setup_module(nn.ReLU())


def test_optimizer_that_already_stepped_cannot_follow_the_sharding(fabric1: Fabric) -> None:
    model = nn.Linear(2, 2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    with pytest.raises(RuntimeError, match=r"fabric.setup\(model, Adam\) got an optimizer that already has state"):
        fabric1.setup(model, optimizer)


def test_optimizer_over_other_parameters_is_refused(fabric1: Fabric) -> None:
    # Partly outside: fabric's general check lets this pass on one process; FSDP cannot shard the outside one.
    module = nn.Linear(2, 2)
    optimizer = torch.optim.SGD([*module.parameters(), nn.Parameter(torch.zeros(3, 3))], lr=0.1)
    with pytest.raises(ValueError, match=r"the optimizer holds a parameter of shape \(3, 3\) that is not in the"):
        fabric1.setup(module, optimizer)


def test_no_backward_sync_needs_the_sharded_model(fabric1: Fabric) -> None:
    wrapped = fabric1.setup_module(nn.Linear(2, 2))
    with fabric1.no_backward_sync(wrapped):
        wrapped(torch.ones(1, 2)).sum().backward()
    with pytest.raises(TypeError, match=r"no_backward_sync\(Linear\): this module is not sharded"):
        fabric1.strategy.no_backward_sync(nn.Linear(2, 2), enabled=True)
