"""The multi-process XLA paths with torch_xla faked (see conftest.py): launcher, loader, collectives, steps, errors.

These run in every environment; real runs on a CPU PJRT device are in test_xla_cpu_pjrt.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.environments import XLAEnvironment
from fabric.io import AsyncCheckpointIO, TorchCheckpointIO, XLACheckpointIO
from fabric.precision import HalfPrecision, XLAPrecision
from fabric.strategies import SingleDeviceXLAStrategy, XLAFSDPStrategy, XLAStrategy
from fabric.strategies.launchers.xla import XLALauncher

from .conftest import FakeMpDeviceLoader, FakeXLA, FakeXlaFSDP


def _worker(fabric: Fabric, tag: str) -> dict:
    """Runs in each (fake) process; records which processes rank_zero_only lets through."""
    from fabric.utilities.rank_zero import rank_zero_only

    Path(tag, f"rank{fabric.global_rank}").write_text(str(rank_zero_only(lambda: "zero", default="other")()))
    return {"tag": tag, "rank": fabric.global_rank, "world": fabric.world_size, "t": torch.ones(2)}


def test_defaults_pick_single_xla_for_one_device_and_xla_for_all(fake_xla: FakeXLA) -> None:
    assert isinstance(Fabric(accelerator="tpu", devices=1).strategy, SingleDeviceXLAStrategy)
    picked = Fabric(accelerator="xla", devices=[2]).strategy
    assert isinstance(picked, SingleDeviceXLAStrategy)
    assert picked.root_device == torch.device("xla", 2)
    fabric = Fabric(accelerator="tpu", devices="auto")
    assert isinstance(fabric.strategy, XLAStrategy)
    assert isinstance(fabric.strategy.precision, XLAPrecision)
    assert isinstance(fabric.strategy.cluster_environment, XLAEnvironment)
    launcher = fabric.strategy.launcher
    assert isinstance(launcher, XLALauncher)
    assert (launcher.num_processes, launcher.start_method, launcher.is_interactive_compatible) == (4, "fork", True)
    assert fabric.world_size == 4  # before the launch: the processes this host will start
    assert isinstance(fabric.strategy.checkpoint_io, XLACheckpointIO)
    own = AsyncCheckpointIO(TorchCheckpointIO())
    assert Fabric(accelerator="tpu", devices=1, plugins=[own]).strategy.checkpoint_io is own


def test_launch_reenters_the_function_in_every_process_and_returns_rank_zeros_result(
    fake_xla: FakeXLA, tmp_path: Path
) -> None:
    fabric = Fabric(accelerator="tpu", devices=4)
    result = fabric.launch(_worker, str(tmp_path))
    assert fake_xla.calls[0] == ("spawn", None, "fork")  # None: torch_xla starts one process per device
    assert result["tag"] == str(tmp_path) and result["rank"] == 0 and result["world"] == 4
    # rank_zero_only (loggers, rank_zero_warn) knows the ranks torch_xla gave the processes.
    assert [(tmp_path / f"rank{r}").read_text() for r in range(4)] == ["zero", "other", "other", "other"]
    assert result["t"].device.type == "cpu"
    ends = [call for call in fake_xla.calls if call[:2] == ("rendezvous", "fabric-launch-end")]
    assert len(ends) == 4  # every process waits for the others before leaving


def test_one_device_runs_in_this_process(fake_xla: FakeXLA, tmp_path: Path) -> None:
    fabric = Fabric(accelerator="tpu", strategy="xla", devices=1)
    assert fabric.launch(_worker, str(tmp_path))["world"] == 4  # world size as torch_xla's runtime reports it
    assert fake_xla.calls[0] == ("spawn", 1, "fork")


def test_launch_needs_a_function(fake_xla: FakeXLA) -> None:
    fabric = Fabric(accelerator="tpu", devices=4)
    with pytest.raises(TypeError, match=r"starts new processes that run a function.*fabric.launch\(train\)"):
        fabric.launch()


def test_launcher_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match=r"start_method='popen'.*'fork', 'spawn' or 'forkserver'"):
        XLALauncher(2, start_method="popen")
    with pytest.raises(ValueError, match=r"num_processes=0.*at least one"):
        XLALauncher(0)


def _in_process(fake: FakeXLA, strategy: XLAStrategy | XLAFSDPStrategy, rank: int = 1) -> Fabric:
    """A Fabric as it is inside launched process `rank` (without launching)."""
    fabric = Fabric(accelerator="tpu", devices=4, strategy=strategy)
    fake.ordinal = rank
    fabric.strategy.setup_environment()
    fabric._launched = True
    return fabric


def test_dataloader_gets_a_distributed_sampler_and_the_device_loader(fake_xla: FakeXLA) -> None:
    fabric = _in_process(fake_xla, XLAStrategy(), rank=1)
    loader = torch.utils.data.DataLoader(torch.arange(16.0), batch_size=2, shuffle=True)
    wrapped = fabric.setup_dataloaders(loader)
    inner = wrapped.dataloader
    assert isinstance(inner, FakeMpDeviceLoader)
    assert inner.device == fabric.device
    sampler = inner.sampler
    assert isinstance(sampler, torch.utils.data.DistributedSampler)
    assert (sampler.num_replicas, sampler.rank, sampler.shuffle) == (4, 1, True)
    assert inner.dataset is loader.dataset and inner.batch_size == 2 and inner.num_workers == 0
    assert len(wrapped) == 2  # 16 items / 4 processes / batches of 2
    assert sum(len(batch) for batch in wrapped) == 4


def test_collectives_go_through_torch_xla(fake_xla: FakeXLA) -> None:
    fabric = _in_process(fake_xla, XLAStrategy(), rank=2)
    value = torch.tensor([1.0, 3.0])
    assert fabric.all_reduce(value).tolist() == [1.0, 3.0]  # sum over 4 processes / 4
    assert fabric.all_reduce(value, reduce_op="sum").tolist() == [4.0, 12.0]
    fabric.all_reduce(value, reduce_op="max")
    fabric.all_reduce(torch.tensor(3), reduce_op="mean")
    reduces = [call for call in fake_xla.calls if call[0] == "all_reduce"]
    assert [call[1] for call in reduces] == ["sum", "sum", "max", "sum"]
    assert reduces[-1][2].dtype == torch.float32  # an integer mean is computed in float
    assert fabric.all_gather(value).shape == (4, 2)  # stacked along a new first dimension
    assert fabric.all_gather(value, sync_grads=True).shape == (4, 2)
    assert ("all_gather", (1, 2)) in fake_xla.calls and ("differentiable_all_gather", (1, 2)) in fake_xla.calls
    fabric.broadcast(value, src=3)
    assert ("collective_broadcast", 3) in fake_xla.calls
    fabric.barrier("here")
    assert ("rendezvous", "here", b"") in fake_xla.calls


def test_object_broadcast_sends_only_the_sources_bytes(fake_xla: FakeXLA) -> None:
    source = _in_process(fake_xla, XLAStrategy(), rank=0)
    assert source.broadcast({"a": [1, 2]}) == {"a": [1, 2]}
    assert fake_xla.calls[-1] == ("rendezvous", "fabric-broadcast", pickle.dumps({"a": [1, 2]}))
    other = _in_process(fake_xla, XLAStrategy(), rank=1)
    fake_xla.peer_payloads = [b"", b"", pickle.dumps("from two"), b""]
    assert other.broadcast({"ignored": True}, src=2) == "from two"
    assert fake_xla.calls[-1] == ("rendezvous", "fabric-broadcast", b"")


def test_collective_errors(fake_xla: FakeXLA) -> None:
    fabric = _in_process(fake_xla, XLAStrategy())
    with pytest.raises(ValueError, match=r"all_reduce\(group=.*process groups do not apply to XLA"):
        fabric.strategy.all_reduce(torch.ones(1), group=object())
    with pytest.raises(ValueError, match=r"reduce_op='median'.*unknown reduction"):
        fabric.all_reduce(torch.ones(1), reduce_op="median")
    with pytest.raises(TypeError, match=r"all_gather\(list\): the XLA strategies gather tensors only"):
        fabric.strategy.all_gather([1, 2])  # type: ignore[arg-type]


def test_collectives_before_the_launch_do_nothing(fake_xla: FakeXLA) -> None:
    fabric = Fabric(accelerator="tpu", devices=4)
    value = torch.ones(2)
    assert fabric.strategy.all_reduce(value) is value
    assert fabric.strategy.broadcast("x") == "x"
    fabric.strategy.barrier()
    assert fake_xla.calls == []
    with pytest.raises(RuntimeError, match=r"root_device: each process's XLA device exists only inside"):
        _ = fabric.strategy.root_device


def test_optimizer_step_is_torch_xlas_and_replicas_start_equal(fake_xla: FakeXLA) -> None:
    fabric = _in_process(fake_xla, XLAStrategy())
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = fabric.setup(model, optimizer)
    assert ("broadcast_master_param",) in fake_xla.calls
    before = model.weight.detach().clone()
    fabric.backward(model(torch.ones(1, 2)).sum())
    with fabric.no_backward_sync(model):  # gradients are reduced in the step, not in backward: nothing to skip
        pass
    optimizer.step()
    assert ("optimizer_step", True, {}) in fake_xla.calls  # barrier=True: the graph runs once per step
    assert not torch.equal(before, model.weight)


def test_unsynced_modules_are_not_broadcast(fake_xla: FakeXLA) -> None:
    fabric = _in_process(fake_xla, XLAStrategy(sync_module_states=False))
    fabric.setup(nn.Linear(2, 2))
    assert ("broadcast_master_param",) not in fake_xla.calls


def test_precision_names(fake_xla: FakeXLA) -> None:
    for name, dtype in (("32-true", torch.float32), ("bf16-true", torch.bfloat16), ("bf16-mixed", torch.float32),
                        ("16-true", torch.float16)):  # fmt: skip
        precision = Fabric(accelerator="tpu", devices=1, precision=name).strategy.precision
        assert isinstance(precision, XLAPrecision) and precision.dtype == dtype
    with pytest.raises(ValueError, match=r"precision='16-mixed'.*Use precision='bf16-mixed'"):
        Fabric(accelerator="tpu", devices=1, precision="16-mixed")
    with pytest.raises(ValueError, match=r"precision='64-true'.*TPUs have no float64"):
        Fabric(accelerator="tpu", devices=1, precision="64-true")
    with pytest.raises(ValueError, match=r"XLAPrecision\(precision='8-true'\): unknown precision for XLA"):
        XLAPrecision("8-true")


def test_pairing_errors(fake_xla: FakeXLA) -> None:
    with pytest.raises(ValueError, match=r"strategy='ddp'.*does not drive XLA devices.*'single_xla', 'xla'"):
        Fabric(accelerator="tpu", devices=4, strategy="ddp")
    with pytest.raises(ValueError, match=r"strategy='xla', accelerator=CPUAccelerator.*run only on XLA devices"):
        Fabric(accelerator="cpu", devices=2, strategy="xla")
    with pytest.raises(TypeError, match=r"plugins=\[HalfPrecision\]\): the XLA strategies need XLAPrecision"):
        Fabric(accelerator="tpu", devices=1, strategy="single_xla", plugins=[HalfPrecision("bf16-true")])
    with pytest.raises(ValueError, match=r"devices=2\): torch_xla runs either one device or all 4"):
        Fabric(accelerator="tpu", devices=2)


def test_several_cpu_devices_are_refused_with_the_reason(fake_xla: FakeXLA, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    monkeypatch.setenv("CPU_NUM_DEVICES", "4")
    with pytest.raises(RuntimeError, match=r"strategy='xla', devices=4\) with PJRT_DEVICE=CPU.*pytorch/xla#9496"):
        Fabric(accelerator="xla", devices=4)
    with pytest.raises(RuntimeError, match=r"strategy='xla_fsdp', devices=4\) with PJRT_DEVICE=CPU"):
        Fabric(accelerator="xla", devices=4, strategy="xla_fsdp")
    assert isinstance(Fabric(accelerator="xla", devices=1, strategy="xla").strategy, XLAStrategy)


def test_environment_reads_torch_xlas_runtime(fake_xla: FakeXLA) -> None:
    fake_xla.ordinal = 3
    env = XLAEnvironment()
    assert (env.world_size(), env.global_rank(), env.local_rank(), env.node_rank()) == (4, 3, 3, 0)
    assert not env.creates_processes_externally
    assert XLAEnvironment.detect()
    with pytest.raises(RuntimeError, match=r"main_address: torch_xla's runtime connects the processes itself"):
        _ = env.main_address
    with pytest.raises(RuntimeError, match=r"main_port: torch_xla's runtime connects the processes itself"):
        _ = env.main_port


# -- xla_fsdp ------------------------------------------------------------------------------------------------------
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(x)


def test_xla_fsdp_wraps_with_the_policies_and_the_precisions_dtype(fake_xla: FakeXLA) -> None:
    strategy = XLAFSDPStrategy(
        auto_wrap_policy={Block}, activation_checkpointing_policy={Block}, reshard_after_forward=False
    )
    fabric = Fabric(accelerator="tpu", devices=4, strategy=strategy, precision="bf16-true")
    fake_xla.ordinal = 1
    fabric.strategy.setup_environment()
    fabric._launched = True
    model = fabric.setup_module(nn.Sequential(Block()))
    wrapper = model._forward_module
    assert isinstance(wrapper, FakeXlaFSDP)
    assert wrapper.kwargs["compute_dtype"] == torch.bfloat16
    assert wrapper.kwargs["reshard_after_forward"] is False
    assert wrapper.kwargs["auto_wrap_policy"].keywords == {"transformer_layer_cls": {Block}}
    assert wrapper.kwargs["auto_wrapper_callable"].args == ((Block,),)
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    fabric.backward(model(torch.ones(1, 2, dtype=torch.bfloat16)).float().sum())
    fabric.clip_gradients(model, optimizer, max_norm=2.0)
    assert wrapper.clipped == [(2.0, 2.0)]
    with fabric.no_backward_sync(model):
        pass
    optimizer.step()
    assert "optimizer_step" not in fake_xla.names()  # gradients were reduce-scattered in backward
    assert fake_xla.names()[-1] == "sync"


def test_xla_fsdp_errors(fake_xla: FakeXLA, tmp_path: Path) -> None:
    fabric = _in_process(fake_xla, XLAFSDPStrategy())
    model = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match=r"fabric.setup\(model, optimizer\) with strategy='xla_fsdp'.*setup_module"):
        fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match=r"setup_optimizers\(SGD\): the optimizer holds none of the sharded"):
        fabric.setup_optimizers(torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))
    wrapped = fabric.setup_module(nn.Linear(2, 2))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(wrapped.parameters(), lr=0.1))
    with pytest.raises(NotImplementedError, match=r"clip_gradients\(clip_val=1.0\).*clips gradients by norm only"):
        fabric.clip_gradients(wrapped, optimizer, clip_val=1.0)
    with pytest.raises(TypeError, match=r"no_backward_sync\(Linear\).*not sharded by the strategy"):
        fabric.strategy.no_backward_sync(nn.Linear(2, 2), enabled=True)
    with pytest.raises(ValueError, match=r"save\(state with keys \['step'\]\).*holds no model set up"):
        fabric.save(tmp_path / "ckpt", {"step": 1})
    with pytest.raises(ValueError, match=r"state_dict_type='both'\): unknown checkpoint layout"):
        XLAFSDPStrategy(state_dict_type="both")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"activation_checkpointing_policy=\[.*expected a set of layer classes"):
        XLAFSDPStrategy(activation_checkpointing_policy=[Block])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"auto_wrapper_callable=...\): both decide how submodules are wrapped"):
        XLAFSDPStrategy(activation_checkpointing_policy={Block}, auto_wrapper_callable=lambda m: m)
