"""FSDP with CPU offload clips gradients by the global norm over offloaded (CPU) shards, like raw DDP.

scripts/fsdp_offload_clip.py trains on 2 CPU ranks over the mixed backend string "cpu:gloo,cuda:gloo" (what FSDP
picks on GPUs with offload, gloo standing in for NCCL) and runs raw DDP with clip_grad_norm_ as the reference.
Tolerance as in test_fsdp.py: reduce-scatter and all-reduce add in different orders. The same run then trains in
float16 with FSDP's ShardedGradScaler and checks that its state comes back from a sharded checkpoint.
"""

from __future__ import annotations

from typing import Any

import _it_runner as runner
import pytest
import torch

from fabric import Fabric
from fabric.strategies import FSDPStrategy

pytestmark = pytest.mark.multiprocess
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    outdir = tmp_path_factory.mktemp("fsdp_offload")
    run = runner.run_script("fsdp_offload_clip.py", str(outdir), "cpu", timeout=180)
    assert run.returncode == 0, run.output
    loaded = [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]
    for rank, result in enumerate(loaded):
        assert "error" not in result, f"rank {rank}:\n{result['error']}"
    return loaded


def test_offloaded_clipping_matches_ddp(results: list[dict[str, Any]]) -> None:
    for result in results:
        assert result["backend"] == "cpu:gloo,cuda:gloo"
        fsdp, ddp = result["fsdp"], result["ddp"]
        assert fsdp["shard_devices"] == ["cpu"] and fsdp["grad_devices"] == ["cpu"]
        assert min(ddp["norms"]) > 0.5, "every step must actually clip"
        torch.testing.assert_close(fsdp["norms"], ddp["norms"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(fsdp["losses"], ddp["losses"], rtol=RTOL, atol=ATOL)
        for name, expected in ddp["weights"].items():
            torch.testing.assert_close(fsdp["weights"][name], expected, rtol=RTOL, atol=ATOL, msg=name)


def test_loss_scaler_state_survives_a_sharded_checkpoint(results: list[dict[str, Any]]) -> None:
    for result in results:
        scaler = result["scaler"]
        assert scaler["saved"]["scale"] < 2.0**24, "the scale must have moved away from its initial value"
        assert scaler["loaded"] == scaler["saved"]
        assert scaler["remainder"] == []
    assert results[0]["scaler"]["saved"] == results[1]["scaler"]["saved"], "ranks agree on the scale"


@pytest.mark.usefixtures("no_cluster_env")
def test_offload_on_gpus_gives_cpu_tensors_to_gloo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    offload = Fabric(accelerator="cuda", strategy=FSDPStrategy(cpu_offload=True), devices=2)
    assert offload.strategy.process_group_backend == "cpu:gloo,cuda:nccl"
    plain = Fabric(accelerator="cuda", strategy=FSDPStrategy(), devices=2)
    assert plain.strategy.process_group_backend == "nccl"
    chosen_strategy = FSDPStrategy(cpu_offload=True, process_group_backend="gloo")
    chosen = Fabric(accelerator="cuda", strategy=chosen_strategy, devices=2)
    assert chosen.strategy.process_group_backend == "gloo", "the user's choice wins"
    on_cpu = Fabric(accelerator="cpu", strategy=FSDPStrategy(cpu_offload=True), devices=2)
    assert on_cpu.strategy.process_group_backend == "gloo"
