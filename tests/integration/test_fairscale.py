"""ddp_sharded (fairscale OSS + ShardedDataParallel) on two real CPU processes over gloo, compared with torch's DDP.

scripts/fairscale_ranks.py runs every scenario once in two forked ranks (then one process for reloading); the tests
below assert on what each process observed. scripts/fairscale_launch.py runs the five lines under both launchers.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest
import torch

pytest.importorskip("fairscale", reason='fairscale is not installed (pip install "torchfabric[fairscale]")')

pytestmark = pytest.mark.multiprocess

# OSS.clip_grad_norm sums the squared norms of each rank's shard and all-reduces them; torch's clip_grad_norm_ takes
# the norm of all per-parameter norms at once. The order differs, so the norm moves by a float32 ulp or two, and so
# do the clipped weights (~0.5): a few 1e-8.
CLIP_ATOL = 1e-6


@pytest.fixture(scope="module")
def outdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fairscale")
    run = runner.run_script("fairscale_ranks.py", str(folder), timeout=300)
    assert run.returncode == 0, run.output
    return folder


def _check(outdir: Path, name: str) -> list[Any]:
    """One check's result on rank 0 and rank 1, failing with the rank's traceback if it raised."""
    results = [torch.load(outdir / f"rank{rank}.pt", weights_only=False)[name] for rank in (0, 1)]
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "Traceback" in str(result.get("error", "")):
            pytest.fail(f"{name} raised on rank {rank}:\n{result['error']}")
    return results


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _same_optimizer_state(a: dict[str, Any], b: dict[str, Any]) -> bool:
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    return all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in a["state"] for k in a["state"][i])


def test_fairscale_alone_drifts_from_ddp_with_default_zero_grad(outdir: Path) -> None:
    # The bug fabric removes: with gradient buckets, zero_grad()'s set_to_none detaches param.grad from the bucket.
    for result in _check(outdir, "parity"):
        assert _max_diff(result["raw_fairscale"]["weights"], result["ddp_adamw"]["weights"]) > 1e-2


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("buckets", ["sharded", "buckets", "small_buckets"])
def test_matches_ddp_bit_for_bit_under_default_zero_grad(outdir: Path, optimizer: str, buckets: str) -> None:
    # sharded: no buckets (one node's default); buckets: one per owner; small_buckets: some gradients bucketed.
    for rank, result in enumerate(_check(outdir, "parity")):
        ours, ddp = result[f"{buckets}_{optimizer}"], result[f"ddp_{optimizer}"]
        assert ours["losses"] == ddp["losses"], f"rank {rank}"
        assert _max_diff(ours["weights"], ddp["weights"]) == 0.0, f"rank {rank}"
        # optimizer.state_dict() through fabric gathers every shard: DDP's plain optimizer state, on every rank.
        assert _same_optimizer_state(ours["optimizer"], ddp["optimizer"]), f"rank {rank}"


@pytest.mark.parametrize("run", ["sharded_accumulate", "buckets_accumulate"])
def test_no_backward_sync_accumulates_like_ddp_no_sync(outdir: Path, run: str) -> None:
    for rank, result in enumerate(_check(outdir, "parity")):
        assert result[run]["losses"] == result["ddp_accumulate"]["losses"], f"rank {rank}"
        assert _max_diff(result[run]["weights"], result["ddp_accumulate"]["weights"]) == 0.0, f"rank {rank}"


def test_eval_mode_between_steps_keeps_the_equality(outdir: Path) -> None:
    for rank, result in enumerate(_check(outdir, "parity")):
        assert result["buckets_evaluate"]["losses"] == result["ddp_evaluate"]["losses"], f"rank {rank}"
        assert len(result["ddp_evaluate"]["losses"]) == 8  # training and validation losses alternate
        assert _max_diff(result["buckets_evaluate"]["weights"], result["ddp_evaluate"]["weights"]) == 0.0


def test_clip_gradients_uses_the_norm_over_all_shards(outdir: Path) -> None:
    for rank, result in enumerate(_check(outdir, "parity")):
        ours, ddp = result["sharded_clip"], result["ddp_clip"]
        assert ours["norms"] == pytest.approx(ddp["norms"], rel=1e-6), f"rank {rank}"
        assert all(norm > 0.05 for norm in ddp["norms"])  # so clipping really changed every step
        assert _max_diff(ours["weights"], ddp["weights"]) <= CLIP_ATOL
        assert _max_diff(ours["weights"], result["sharded_adamw"]["weights"]) > 1e-4  # clipped != unclipped


def test_bf16_mixed_matches_ddp_under_autocast(outdir: Path) -> None:
    for rank, result in enumerate(_check(outdir, "parity")):
        assert result["sharded_bf16"]["losses"] == result["ddp_bf16"]["losses"], f"rank {rank}"
        assert _max_diff(result["sharded_bf16"]["weights"], result["ddp_bf16"]["weights"]) == 0.0, f"rank {rank}"
        assert _max_diff(result["sharded_bf16"]["weights"], result["sharded_adamw"]["weights"]) > 0.0  # bf16 ran


def test_bf16_true_matches_ddp_of_a_bfloat16_model(outdir: Path) -> None:
    # Parameters, bucketed gradients (reduced over gloo in bfloat16) and the sharded AdamW state all in bfloat16.
    for rank, result in enumerate(_check(outdir, "parity")):
        ours, ddp = result["sharded_bf16_true"], result["ddp_bf16_true"]
        assert ours["losses"] == ddp["losses"], f"rank {rank}"
        assert all(value.dtype == torch.bfloat16 for value in ours["weights"].values())
        assert _max_diff(ours["weights"], ddp["weights"]) == 0.0, f"rank {rank}"
        assert _same_optimizer_state(ours["optimizer"], ddp["optimizer"]), f"rank {rank}"


def test_16_mixed_with_a_sharded_scaler_matches_ddp_with_a_grad_scaler(outdir: Path) -> None:
    # float16 autocast on the CPU with the loss scaled: OSS's step goes through torch's ShardedGradScaler.
    for rank, result in enumerate(_check(outdir, "parity")):
        assert result["sharded_fp16"]["losses"] == result["ddp_fp16"]["losses"], f"rank {rank}"
        assert _max_diff(result["sharded_fp16"]["weights"], result["ddp_fp16"]["weights"]) == 0.0, f"rank {rank}"
        assert _max_diff(result["sharded_fp16"]["weights"], result["sharded_adamw"]["weights"]) > 0.0
        assert result["fp16_scale"] == 2.0**16  # the scaler ran (and saw no overflow in these steps)


def test_lr_scheduler_made_before_setup_steers_the_sharded_optimizer(outdir: Path) -> None:
    for result in _check(outdir, "scheduler"):
        assert result["sharded"]["lr"] == result["ddp"]["lr"] == pytest.approx(0.1 * 0.5**4)
        assert _max_diff(result["sharded"]["weights"], result["ddp"]["weights"]) == 0.0


def test_checkpoint_resumes_the_same_run(outdir: Path) -> None:
    for rank, result in enumerate(_check(outdir, "checkpoint")):
        assert result["observed"] == result["expected"], f"rank {rank}"
        assert result["step"] == 2
        assert result["resumed_equal"], f"rank {rank}: the step after loading differs from the uninterrupted run"


def test_checkpoint_holds_the_consolidated_optimizer_state_of_ddp(outdir: Path) -> None:
    single = torch.load(outdir / "single.pt", weights_only=False)
    if "error" in single:
        pytest.fail(f"the single process raised:\n{single['error']}")
    ddp = _check(outdir, "checkpoint")[0]
    saved = single["file"]
    # One plain file: DDP's optimizer state after the same 2 steps, whole (not rank 0's shard), and DDP's weights.
    assert _same_optimizer_state(saved["optimizer"], ddp["ddp_optimizer"])
    assert _max_diff(saved["model"], ddp["ddp_weights"]) == 0.0
    assert saved["step"] == 2
    # It loaded into a plain AdamW in one process (which then stepped: step 3), and into ddp_sharded on 1 rank.
    assert [state["step"].item() for state in single["stepped_state"]["state"].values()] == [3.0] * 6
    assert _same_optimizer_state(single["sharded_state"], saved["optimizer"])
    assert _max_diff(single["sharded_weights"], saved["model"]) == 0.0


def test_misuse_gives_its_error_on_every_rank(outdir: Path) -> None:
    for result in _check(outdir, "errors"):
        # Wholly foreign: fabric's general check (tests/test_mistakes.py); partly foreign: the strategy's own.
        assert "none of the optimizer's 6 parameters belongs to the model" in result["foreign_optimizer"]
        assert "6 of the optimizer's parameters do not belong to the model" in result["partly_foreign_optimizer"]
        assert result["setup_module"].startswith("RuntimeError: fabric.setup_module(Sequential) with strategy")
        assert result["setup_without_optimizer"].startswith(
            "RuntimeError: fabric.setup(Sequential) without an optimizer with strategy 'ddp_sharded'"
        )
        assert "for a model without optimizer (inference), use strategy='ddp'" in result["setup_without_optimizer"]
        assert "must see the model and its optimizers together" in result["setup_optimizers"]
        assert "contains fairscale's FullyShardedDataParallel" in result["fairscale_fsdp"]
        assert "needs CUDA streams" in result["fairscale_fsdp"]
        assert "the total gradient norm is nan" in result["nonfinite_clip"]
        assert "needs the optimizer returned by fabric.setup(model, optimizer)" in result["plain_optimizer_clip"]


@pytest.mark.parametrize("strategy", ["ddp_sharded", "ddp_sharded_spawn"])
def test_five_lines_under_each_launcher_match_ddp(tmp_path: Path, strategy: str) -> None:
    run = runner.run_script("fairscale_launch.py", str(tmp_path), strategy, timeout=180)
    assert run.returncode == 0, run.output
    result = json.loads((tmp_path / "result.json").read_text())
    assert result == {"equal": True, "batches": [4, 4], "world_size": 2, "strategy": "DDPShardedStrategy"}
