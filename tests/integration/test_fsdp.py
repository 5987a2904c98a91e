"""FSDP (fully_shard) on 2 CPU ranks over gloo: training matches raw DDP, and every setup path and option trains.

scripts/fsdp_spawn.py starts one 2-process run with the spawn launcher (to keep the suite fast), and there runs
scripts/fsdp_train.py's checks; raw DDP runs in the same process group from the same seed on the same batches and is
the reference. (The script launcher with FSDP is exercised by test_fsdp_offload_clip.py and the sharded checkpoint
tests.)

Tolerance: FSDP computes the same forward on all-gathered parameters, but averages gradients with a
reduce-scatter instead of DDP's all-reduce, and may divide before or after reducing. Those are different
floating-point operation orders, so equality is only guaranteed to rounding: losses, norms and weights must
agree within rtol=1e-5, atol=1e-6 (a real bug, like a missing or doubled gradient average, is off by ~50%).
On gloo with 2 ranks the results are in fact bitwise equal today; the test does not rely on that.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest
import torch

pytestmark = pytest.mark.multiprocess
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def outdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One spawn-launched job for the whole module: the spawn launcher's own run, then every check."""
    folder = tmp_path_factory.mktemp("fsdp")
    run = runner.run_script("fsdp_spawn.py", str(folder), timeout=240)
    assert run.returncode == 0, run.output
    return folder


@pytest.fixture(scope="module")
def results(outdir: Path) -> list[dict[str, Any]]:
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _check(results: list[dict[str, Any]], name: str) -> dict[str, Any]:
    for rank, result in enumerate(results):
        assert "error" not in result[name], f"rank {rank}, check {name}:\n{result[name]['error']}"
    return results[0][name]


def _assert_close_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], rtol=RTOL, atol=ATOL, msg=f"{what}: {key}")


def test_losses_and_weights_match_ddp(results: list[dict[str, Any]]) -> None:
    parity = _check(results, "parity")
    ddp = parity["ddp"]
    for variant in ("separate", "joint"):  # setup_module + setup_optimizers, and setup(model, optimizer)
        torch.testing.assert_close(parity[variant]["losses"], ddp["losses"], rtol=RTOL, atol=ATOL)
        _assert_close_weights(parity[variant]["weights"], ddp["weights"], f"{variant} vs DDP")
        assert parity[variant]["param_types"] == ["DTensor"]
    assert ddp["losses"][-1] < ddp["losses"][0], "training did not reduce the loss"


def test_each_rank_holds_only_its_shard(results: list[dict[str, Any]]) -> None:
    total = sum(p.numel() for p in _check(results, "parity")["ddp"]["weights"].values())
    local = [r["parity"]["separate"]["local_numel"] for r in results]
    assert sum(local) == total and max(local) < total


def test_both_setup_orders_give_the_same_run(results: list[dict[str, Any]]) -> None:
    parity = _check(results, "parity")
    assert parity["separate"]["losses"] == parity["joint"]["losses"]
    for key, value in parity["separate"]["weights"].items():
        assert torch.equal(value, parity["joint"]["weights"][key]), key


def test_clip_gradients_returns_the_unsharded_norm(results: list[dict[str, Any]]) -> None:
    clipping = _check(results, "clipping")
    torch.testing.assert_close(clipping["fsdp"]["norms"], clipping["ddp"]["norms"], rtol=RTOL, atol=ATOL)
    assert all(norm > 0.5 for norm in clipping["ddp"]["norms"]), "max_norm=0.5 must actually clip"
    _assert_close_weights(clipping["fsdp"]["weights"], clipping["ddp"]["weights"], "clipped FSDP vs DDP")
    assert results[1]["clipping"]["fsdp"]["norms"] == clipping["fsdp"]["norms"], "ranks disagree on the norm"


def test_no_backward_sync_accumulates_like_ddp_no_sync(results: list[dict[str, Any]]) -> None:
    accumulation = _check(results, "accumulation")
    torch.testing.assert_close(accumulation["fsdp"]["losses"], accumulation["ddp"]["losses"], rtol=RTOL, atol=ATOL)
    _assert_close_weights(accumulation["fsdp"]["weights"], accumulation["ddp"]["weights"], "accumulation")
    plain = results[0]["parity"]["ddp"]["weights"]
    assert any(not torch.allclose(plain[k], accumulation["ddp"]["weights"][k]) for k in plain)


def test_auto_wrap_checkpointing_and_cpu_offload_train_like_ddp(results: list[dict[str, Any]]) -> None:
    options = _check(results, "options")
    ddp = results[0]["parity"]["ddp"]
    torch.testing.assert_close(options["losses"], ddp["losses"], rtol=RTOL, atol=ATOL)
    _assert_close_weights(options["weights"], ddp["weights"], "auto-wrap + checkpointing + offload")
    assert options["wrapped"] == ["FSDPBlock", "FSDPBlock", "FSDPSequential"]


def test_empty_init_on_meta_then_training(results: list[dict[str, Any]]) -> None:
    empty = _check(results, "empty_init")
    assert empty["on_meta"]
    for name, value in empty["initial"].items():
        assert torch.isfinite(value).all() and value.std() > 0, name
    # Each rank kept a different slice of one full draw: no rank repeats another's values (drawing on the
    # shards directly would give every CPU rank the same numbers).
    for name, value in empty["local"].items():
        assert not torch.equal(value, results[1]["empty_init"]["local"][name]), name
    assert empty["losses"][-1] < empty["losses"][0]


def test_bf16_mixed_computes_in_bfloat16_on_float32_shards(results: list[dict[str, Any]]) -> None:
    bf16 = _check(results, "bf16_mixed")
    assert bf16["weight_dtype_in_forward"] == "torch.bfloat16"
    assert bf16["shard_dtypes"] == ["torch.float32"]
    # bfloat16 has 8 bits of mantissa: losses follow the float32 run to about 1%.
    torch.testing.assert_close(bf16["losses"], results[0]["parity"]["ddp"]["losses"], rtol=2e-2, atol=1e-2)


def test_sharded_checkpoint_round_trip(results: list[dict[str, Any]]) -> None:
    checkpoint = _check(results, "checkpoint")
    assert checkpoint["step"] == 4
    for key, value in checkpoint["saved"].items():
        assert torch.equal(checkpoint["loaded"][key], value), key
    assert checkpoint["optimizer_keys"] == sorted(checkpoint["saved"])  # momentum buffers, by parameter name


def test_full_checkpoint_is_one_file_and_loads_back(results: list[dict[str, Any]]) -> None:
    full = _check(results, "full_checkpoint")
    assert full["is_file"]
    for key, value in full["saved"].items():
        assert torch.equal(full["loaded"][key], value), key


@pytest.mark.cuda
@pytest.mark.usefixtures("no_cluster_env")
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_on_one_gpu(precision: str) -> None:
    """On CUDA, 16-bit compute uses FSDP's policy; float16 gets the sharded loss scaler. One GPU, in process."""
    from torch import nn

    from fabric import Fabric

    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    fabric = Fabric(accelerator="cuda", strategy="fsdp", devices=1, precision=precision)
    fabric.launch()
    try:
        torch.manual_seed(0)
        model = fabric.setup_module(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1)))
        optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
        losses = []
        for _ in range(3):
            loss = model(torch.randn(4, 8, device=fabric.device)).pow(2).mean()
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=1.0)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        assert all(torch.isfinite(torch.tensor(losses)))
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert all(p.device.type == "cuda" for p in model.parameters())
        if precision == "16-mixed":
            assert type(fabric.strategy.precision.scaler).__name__ == "ShardedGradScaler"  # type: ignore[attr-defined]
    finally:
        fabric.strategy.teardown()


def test_fsdp_trains_under_the_spawn_launcher(outdir: Path) -> None:
    # Rank 0's losses, handed back to the launching process by fabric.launch(fn).
    result = json.loads((outdir / "result.json").read_text())
    assert len(result["fsdp"]) == 3 and result["fsdp"][-1] < result["fsdp"][0]
    # The reference: raw torch DDP on the same batches, in the same spawned processes (scripts/fsdp_spawn.py).
    assert result["fsdp"] == pytest.approx(result["ddp"], abs=1e-6)
