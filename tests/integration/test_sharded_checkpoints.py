"""Sharded checkpoints on real processes: saved by 1 or 2 (FSDP2 over gloo), loaded by 2 and by 1, consolidated.

scripts/shck_ranks.py runs every scenario once; the tests below assert on what each process observed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest
import torch

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def outdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("sharded")
    run = runner.run_script("shck_ranks.py", str(folder), timeout=180)
    assert run.returncode == 0, run.output
    return folder


def _results(outdir: Path, name: str) -> dict[str, Any]:
    return torch.load(outdir / name, weights_only=False)


def _check(outdir: Path, name: str) -> list[Any]:
    """One check's result on rank 0 and rank 1, failing with the rank's traceback if it raised."""
    results = [_results(outdir, f"rank{rank}.pt")[name] for rank in (0, 1)]
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "Traceback" in str(result.get("error", "")):
            pytest.fail(f"{name} raised on rank {rank}:\n{result['error']}")
    return results


def _single(outdir: Path, file: str, name: str) -> Any:
    result = _results(outdir, file)[name]
    if isinstance(result, dict) and "Traceback" in str(result.get("error", "")):
        pytest.fail(f"{name} raised in the single process:\n{result['error']}")
    return result


def _assert_equal(actual: Any, expected: Any, where: str = "") -> None:
    """Nested dicts of tensors equal, bit for bit."""
    if isinstance(expected, dict):
        assert set(actual) == set(expected), where
        for key in expected:
            _assert_equal(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, torch.Tensor):
        assert torch.equal(actual, expected), where
    else:
        assert actual == expected, where


def test_two_ranks_save_and_load_weights_and_optimizer_state(outdir: Path) -> None:
    rank0, rank1 = _check(outdir, "save_and_reload")
    _assert_equal(rank1["saved"], rank0["saved"])
    for result in (rank0, rank1):
        _assert_equal(result["loaded"], rank0["saved"])
        assert len(result["loaded"]["optimizer"]) == 4, "a fresh optimizer received the saved Adam moments"
        assert result["lr"] == 0.01, "the saved param_groups replace the fresh optimizer's"
        assert result["step"] == 7 and result["remainder"] == {}
        assert result["listing"] == [".metadata", "__0_0.distcp", "__1_0.distcp"], "one file per rank + metadata"
        assert not result["staging_left"]


def test_saved_by_one_process_loads_into_two_fsdp_ranks(outdir: Path) -> None:
    expected = _single(outdir, "single.pt", "save_single")
    for result in _check(outdir, "load_saved_by_one"):
        _assert_equal(result, expected)


def test_plain_strategy_file_loads_into_two_fsdp_ranks(outdir: Path) -> None:
    expected = _single(outdir, "single.pt", "save_single")
    for result in _check(outdir, "load_plain_file"):
        _assert_equal(result, expected)


def test_saved_by_two_ranks_loads_in_one_process_without_a_group(outdir: Path) -> None:
    saved = _check(outdir, "save_and_reload")[0]["saved"]
    result = _single(outdir, "after.pt", "load_without_group")
    _assert_equal(result["loaded"], saved)
    assert result["step"] == 7 and result["remainder"] == {}


def test_sharded_checkpoint_loads_into_ddp(outdir: Path) -> None:
    saved = _check(outdir, "save_and_reload")[0]["saved"]
    for result in _check(outdir, "load_into_ddp"):
        _assert_equal(result["model"], saved["model"])
        assert result["remainder"] == ["optimizer", "step"]


def test_plain_fabric_loads_a_checkpoint_written_by_two_fsdp_ranks(outdir: Path) -> None:
    saved = _check(outdir, "save_and_reload")[0]["saved"]
    result = _single(outdir, "after.pt", "fabric_cpu_load")
    _assert_equal(result["model"], saved["model"])
    assert result["step"] == 7 and result["remainder"] == ["optimizer"]


def test_consolidate_gives_plain_tensors_a_plain_model_loads(outdir: Path) -> None:
    saved = _check(outdir, "save_and_reload")[0]["saved"]
    result = _single(outdir, "after.pt", "consolidated")
    _assert_equal(result["whole"]["model"], saved["model"])
    _assert_equal(result["whole"]["optimizer"]["state"], saved["optimizer"])
    assert result["whole"]["step"] == 7
    _assert_equal(dict(result["plain"]), saved["model"])


def test_full_file_round_trip_into_fsdp(outdir: Path) -> None:
    for result in _check(outdir, "full_file"):
        _assert_equal(result["loaded"], result["saved"])
        assert result["step"] == 9
    whole = torch.load(outdir / "full.pt", weights_only=False)
    assert all(type(value) is torch.Tensor for value in whole["model"].values()), "no DTensor in a full file"


def test_failed_save_leaves_the_previous_checkpoint_unchanged(outdir: Path) -> None:
    for result in _check(outdir, "failed_save"):
        assert result["error"] is not None
        assert "writing the sharded checkpoint failed" in result["error"] and "pickle" in result["error"]
        assert "was not changed" in result["error"]
        assert result["unchanged"], "the files of the previous checkpoint changed"
        assert not result["staging_left"], "the partial save was not cleaned up"
    # ...and it still loads (after.pt loaded it after the failure).
    assert _single(outdir, "after.pt", "load_without_group")["step"] == 7


def test_loading_into_another_shape_names_key_and_shapes(outdir: Path) -> None:
    for message in _check(outdir, "wrong_shape"):
        assert message is not None and "'2.weight': saved [4, 8], expected [5, 8]" in message


def test_tensor_parallel_checkpoint_loads_into_a_plain_module(outdir: Path) -> None:
    rank0, rank1 = _check(outdir, "tensor_parallel")
    _assert_equal(rank1, rank0)
    _assert_equal(_single(outdir, "after.pt", "load_tensor_parallel"), rank0)


def test_fabric_fsdp_strategy_round_trip(outdir: Path) -> None:
    for result in _check(outdir, "through_fabric"):
        _assert_equal(result["loaded"], result["saved"])
        assert result["step"] == 11
    assert (outdir / "fabric" / ".metadata").is_file()
