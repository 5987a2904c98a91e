"""Collectives, data sharding, rank_zero_first and checkpoints on 2 real CPU ranks over gloo.

scripts/collectives_checkpoint.py runs every check once (strategy="ddp") and each rank saves what it observed;
the tests below assert on both ranks' observations.
"""

from __future__ import annotations

from typing import Any

import _it_runner as runner
import pytest
import torch
from torch.utils.data import DistributedSampler

pytestmark = pytest.mark.multiprocess
SEED = 7  # the seed the script passes to seed_everything


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' observations, from one run of the script for the whole module."""
    outdir = tmp_path_factory.mktemp("collectives")
    run = runner.run_script("collectives_checkpoint.py", str(outdir), timeout=90)
    assert run.returncode == 0, run.output
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _check(observed: list[dict[str, Any]], name: str) -> list[Any]:
    """One check's result on rank 0 and rank 1, failing with the rank's traceback if the check raised."""
    results = [ranks[name] for ranks in observed]
    for rank, result in enumerate(results):
        if isinstance(result, dict) and "error" in result:
            pytest.fail(f"{name} raised on rank {rank}:\n{result['error']}")
    return results


def test_all_gather_tensor(observed: list[dict[str, Any]]) -> None:
    expected = torch.tensor([[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]])
    for gathered in _check(observed, "gather_tensor"):
        assert torch.equal(gathered, expected)


def test_all_gather_number(observed: list[dict[str, Any]]) -> None:
    for gathered in _check(observed, "gather_number"):
        assert torch.equal(gathered, torch.tensor([1, 11]))


def test_all_gather_nested_collection(observed: list[dict[str, Any]]) -> None:
    for gathered in _check(observed, "gather_nested"):
        assert gathered.keys() == {"t", "inner"} and gathered["inner"].keys() == {"n", "s"}
        assert torch.equal(gathered["t"], torch.tensor([[0, 0], [1, -1]]))
        assert torch.equal(gathered["inner"]["n"], torch.tensor([1, 2]))
        assert torch.equal(gathered["inner"]["s"], torch.tensor([0.5, 1.5])), "0-dim tensors gather to shape (2,)"


def test_all_gather_sync_grads_propagates_gradients(observed: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(_check(observed, "gather_sync_grads")):
        assert torch.equal(result["gathered"], torch.tensor([[1.0], [2.0]]))
        assert result["requires_grad"]
        assert not result["plain_requires_grad"], "without sync_grads the result is not differentiable"
        # Rank j's entry is weighted by (j + 1) in both ranks' losses, scaled by 1 and 2: (j + 1) * 3.
        assert torch.equal(result["grad"], torch.tensor([3.0 * (rank + 1)]))


@pytest.mark.parametrize(
    ("op", "expected"),
    [("sum", [3, 30]), ("mean", [1.5, 15.0]), ("max", [2, 20]), ("min", [1, 10])],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_all_reduce(observed: list[dict[str, Any]], op: str, expected: list[float], dtype: torch.dtype) -> None:
    for result in _check(observed, "all_reduce"):
        reduced = result[f"{op}_{dtype}"]
        expected_dtype = torch.float32 if op == "mean" else dtype  # the mean of integers is a float
        assert reduced.dtype == expected_dtype
        assert torch.equal(reduced, torch.tensor(expected, dtype=expected_dtype))
        assert result[f"{op}_{dtype}_input_unchanged"], "all_reduce must not modify its input"


def test_all_reduce_nested_collection(observed: list[dict[str, Any]]) -> None:
    for result in _check(observed, "all_reduce"):
        assert torch.equal(result["nested_sum"]["a"], torch.tensor(3))
        assert torch.equal(result["nested_sum"]["b"], torch.tensor([2.0]))


def test_broadcast_python_object_from_rank_1(observed: list[dict[str, Any]]) -> None:
    for result in _check(observed, "broadcast"):
        received = result["src1"]
        assert received["sender"] == 1 and received["payload"] == [1, {"nested": "from-1"}]
        assert torch.equal(received["tensor"], torch.tensor([1, 1]))
        assert result["src0"] == "hello from 0"


def test_barrier_waits_for_the_slow_rank(observed: list[dict[str, Any]]) -> None:
    for result in _check(observed, "barrier"):
        assert result["marker_seen_after_barrier"], "rank 0 left the barrier before rank 1 reached it"
        assert result["waited"] >= 0.5, "rank 0 did not wait for rank 1 (which slept 1 s before the barrier)"


def test_rank_zero_first(observed: list[dict[str, Any]]) -> None:
    rank0, rank1 = _check(observed, "rank_zero_first")
    assert not rank0["existed_on_entry"] and rank0["content"] == "prepared by rank 0"
    assert rank1["existed_on_entry"], "rank 1 entered the block before rank 0 had finished it"
    assert rank1["content"] == "prepared by rank 0"


def test_setup_dataloaders_shards_and_reshuffles(observed: list[dict[str, Any]]) -> None:
    rank0, rank1 = _check(observed, "shards")
    assert rank0["sampler"] == rank1["sampler"] == "DistributedSampler"
    for epoch in range(2):
        a, b = rank0["epochs"][epoch], rank1["epochs"][epoch]
        assert len(a) == len(b) == 32
        assert not set(a) & set(b), "the ranks' shards overlap"
        assert sorted(a + b) == list(range(64)), "the shards do not cover the dataset"
    for result in (rank0, rank1):
        assert result["epochs"][0] != result["epochs"][1], "the order did not change between epochs (set_epoch)"
    # The same order as DistributedSampler(shuffle=True, seed=<seed_everything's seed>) with set_epoch.
    for rank, result in enumerate((rank0, rank1)):
        sampler = DistributedSampler(range(64), num_replicas=2, rank=rank, shuffle=True, seed=SEED)  # type: ignore[arg-type]
        for epoch in range(2):
            sampler.set_epoch(epoch)
            assert result["epochs"][epoch] == list(sampler)


def test_save_writes_one_file_from_rank_0_and_load_restores_every_rank(observed: list[dict[str, Any]]) -> None:
    rank0, rank1 = _check(observed, "checkpoint")
    assert len(rank0["writes"]) >= 1 and rank0["writes"][0].endswith("state.ckpt")
    assert rank1["writes"] == [], "only rank 0 writes"
    for result in (rank0, rank1):
        assert result["listing_after_save"] == ["state.ckpt"], "one file, and no temporary file left"
        for key, value in rank0["saved_model"].items():
            assert torch.equal(result["loaded_model"][key], value)
        for loaded, saved in zip(result["loaded_momentum"], rank0["saved_momentum"], strict=True):
            assert torch.equal(loaded, saved)
        assert result["loaded_step"] == 5
        assert result["remainder"] == []


def test_failed_save_leaves_previous_checkpoint_intact(observed: list[dict[str, Any]]) -> None:
    rank0, rank1 = _check(observed, "checkpoint")
    assert rank0["writes"] == [rank0["writes"][0]] * 2, "rank 0 attempted the second save"
    assert rank0["failed_save_error"] is not None and "lambda" in rank0["failed_save_error"]
    for result in (rank0, rank1):
        assert result["digest_unchanged"], "the previous checkpoint's bytes changed"
        assert result["listing_after_failed_save"] == ["state.ckpt"], "a temporary file was left behind"
        for key, value in rank0["saved_model"].items():
            assert torch.equal(result["model_after_failed_save"][key], value)
        assert result["step_after_failed_save"] == 5
