"""AsyncCheckpointIO with real processes: exit right after a save, SIGKILL during writes, 2-rank sharded saves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest
import torch

pytestmark = pytest.mark.multiprocess
KILLS = 20


def test_a_script_that_exits_right_after_saving_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    run = runner.run_script("async_exit.py", str(tmp_path), timeout=120)
    assert run.returncode == 0, run.output
    assert "save returned" in run.stdout
    saved = torch.load(tmp_path / "exit.pt", weights_only=False)
    assert saved["step"] == 42 and torch.equal(saved["weights"], torch.arange(10_000_000, dtype=torch.float32))
    # Failures nobody could raise any more (the Fabric was collected, or the script ended) are printed.
    for name in ("dropped.pt", "kept.pt"):
        assert f"fabric: save('{tmp_path / 'blocker' / name}'): the background write of this checkpoint failed" in (
            run.stderr
        ), run.output


def test_sigkill_during_background_saves_never_breaks_the_checkpoint(tmp_path: Path) -> None:
    run = runner.run_script("async_kill.py", str(tmp_path), str(KILLS), timeout=120)
    assert run.returncode == 0, run.output
    results = json.loads((tmp_path / "result.json").read_text())
    assert len(results) == KILLS
    previous = 0
    for i, result in enumerate(results):
        assert "error" not in result, f"kill {i}: the checkpoint does not load:\n{result['error']}"
        assert result["consistent"] and result["in_range"], f"kill {i}: {result}"
        assert result["version"] >= previous, f"kill {i}: the checkpoint went back to an older version"
        previous = result["version"]
    # The kills must have hit writes in flight (their temporary file was left), or the test proves nothing.
    assert sum(r["mid_write"] for r in results) >= 3, results


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    outdir = tmp_path_factory.mktemp("async_sharded")
    run = runner.run_script("async_sharded.py", str(outdir), timeout=180)
    assert run.returncode == 0, run.output
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _check(results: list[dict[str, Any]], name: str) -> list[Any]:
    for rank, result in enumerate(results):
        assert "error" not in result[name], f"rank {rank}, check {name}:\n{result[name]['error']}"
    return [result[name] for result in results]


def test_sharded_save_returns_with_a_snapshot_while_training_goes_on(sharded: list[dict[str, Any]]) -> None:
    for result in _check(sharded, "snapshot_and_training_during_write"):
        assert result["equal_saved"], "the loaded weights are those at the save call"
        assert result["differs_from_trained"], "training after the call changed the weights, not the checkpoint"
        assert result["step"] == 3
        assert result["listing"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]
        assert not result["staging_left"]


def test_sharded_second_save_is_the_one_on_disk(sharded: list[dict[str, Any]]) -> None:
    for result in _check(sharded, "second_save_wins"):
        assert result["version"] == 2 and result["equal_second"]
        assert result["on_disk"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


def test_sharded_background_failure_is_raised_on_every_rank_and_keeps_the_checkpoint(
    sharded: list[dict[str, Any]],
) -> None:
    for result in _check(sharded, "background_failure"):
        assert result["message"] is not None, "the next barrier raised the failure"
        assert "/ckpt'): writing the sharded checkpoint failed" in result["message"]
        assert "Can't pickle" in result["message"] and "ran in the background" in result["message"]
        assert result["unchanged"] and not result["staging_left"]


def test_ddp_and_full_checkpoints_load_right_after_an_async_save_on_every_rank(
    sharded: list[dict[str, Any]],
) -> None:
    for result in _check(sharded, "other_strategies"):
        assert result["ddp"] == {"step": 4, "equal": True}, "rank 1 read the file only after rank 0 wrote it"
        assert result["full"] == {"step": 4, "equal": True}
        assert result["ddp_raw"] is True


def test_ddp_reserves_the_first_save_s_buffers_on_rank_0_only(sharded: list[dict[str, Any]]) -> None:
    rank0, rank1 = _check(sharded, "ddp_reserves_on_rank_0_only")
    assert rank0 == {"hooks": 1, "reserved": 3 * 2 * 2**20, "equal": True}, "weight, exp_avg, exp_avg_sq"
    assert rank1 == {"hooks": 0, "reserved": 0, "equal": True}, "rank 1 writes nothing, so reserves nothing"


def test_teardown_waits_for_the_last_sharded_save(sharded: list[dict[str, Any]]) -> None:
    for result in sharded:
        assert result["last_complete"] == [".metadata", "__0_0.distcp", "__1_0.distcp"]


@pytest.fixture(scope="module")
def failures(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    outdir = tmp_path_factory.mktemp("async_failure")
    run = runner.run_script("async_failure.py", str(outdir), timeout=240)
    assert run.returncode == 0, run.output
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


@pytest.mark.parametrize("check", ["ddp_barrier", "ddp_next_save"])
def test_a_background_save_that_fails_on_rank_0_raises_the_same_error_on_every_rank(
    failures: list[dict[str, Any]], check: str
) -> None:
    results = _check(failures, check)
    messages = [result["message"] for result in results]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert ".pt'): the background write of this checkpoint failed" in messages[0]
    assert "Can't pickle" in messages[0] and "failed on global rank 0; every rank raises this error" in messages[0]
    assert all(result["version"] == 1 for result in results), "the checkpoint saved before is intact"


def test_a_failed_publish_of_an_async_sharded_save_raises_on_every_rank(failures: list[dict[str, Any]]) -> None:
    results = _check(failures, "fsdp_publish")
    messages = [result["message"] for result in results]
    assert messages[0] is not None and messages[0] == messages[1], messages
    assert "cannot publish" in messages[0] and "(injected)" in messages[0]
    assert "failed on global rank 0; every rank raises this error" in messages[0]
    assert all(result["version"] == 1 and result["unchanged"] for result in results)
