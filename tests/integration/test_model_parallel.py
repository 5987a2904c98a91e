"""ModelParallelStrategy on 2 CPU ranks over gloo: tensor parallel (tp=2) and data parallel (dp=2).

scripts/mp_train.py runs every check in one 2-process run. References: for tp=2 (one replica) plain local
training on the same batches; for dp=2 raw DDP on the same batches. Tolerance rtol=1e-5, atol=1e-6: a
row-wise parallel layer sums partial products across ranks, a different operation order than one local matmul,
and FSDP's reduce-scatter is not DDP's all-reduce, so the results are only equal to rounding.
"""

from __future__ import annotations

from typing import Any

import _it_runner as runner
import pytest
import torch

pytestmark = pytest.mark.multiprocess
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    outdir = tmp_path_factory.mktemp("model_parallel")
    run = runner.run_script("mp_train.py", str(outdir), timeout=180)
    assert run.returncode == 0, run.output
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _check(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    for rank, result in enumerate(results):
        assert "error" not in result[name], f"rank {rank}, check {name}:\n{result[name]['error']}"
    return [result[name] for result in results]


def _assert_matches_reference(check: dict[str, Any]) -> None:
    fabric, reference = check["fabric"], check["reference"]
    torch.testing.assert_close(fabric["losses"], reference["losses"], rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(fabric["norms"], reference["norms"], rtol=RTOL, atol=ATOL)
    assert fabric["weights"].keys() == reference["weights"].keys()
    for key, value in reference["weights"].items():
        torch.testing.assert_close(fabric["weights"][key], value, rtol=RTOL, atol=ATOL, msg=key)


def test_auto_sizes_on_one_machine_are_all_tensor_parallel(results: list[dict[str, Any]]) -> None:
    assert results[0]["auto_sizes"] == (1, 2)


def test_tensor_parallel_matches_unsharded_training(results: list[dict[str, Any]]) -> None:
    rank0, rank1 = _check(results, "tp2")
    _assert_matches_reference(rank0)
    assert rank0["fabric"]["placements"]["0.weight"].endswith("Shard(dim=0))")  # column-wise
    assert rank0["fabric"]["placements"]["2.weight"].endswith("Shard(dim=1))")  # row-wise
    assert not torch.equal(rank0["fabric"]["local"]["0.weight"], rank1["fabric"]["local"]["0.weight"])


def test_tensor_parallel_ranks_read_the_same_batches(results: list[dict[str, Any]]) -> None:
    rank0, rank1 = _check(results, "tp2")
    assert len(rank0["batches"]) == 4  # one replica reads all 32 samples
    for a, b in zip(rank0["batches"], rank1["batches"], strict=True):
        assert torch.equal(a, b)


def test_data_parallel_matches_ddp_and_splits_the_data(results: list[dict[str, Any]]) -> None:
    rank0, rank1 = _check(results, "dp2")
    _assert_matches_reference(rank0)
    seen = torch.cat([*rank0["batches"], *rank1["batches"]])
    assert seen.shape[0] == 32 and torch.unique(seen, dim=0).shape[0] == 32


def test_meta_init_with_tensor_parallel_agrees_where_replicated(results: list[dict[str, Any]]) -> None:
    rank0, rank1 = _check(results, "tp2_empty_init")
    for name, value in rank0["local"].items():
        assert torch.isfinite(value).all() and value.std() > 0, name
    # The row-wise layer's bias is replicated over the tensor-parallel ranks; the sharded weights differ.
    assert torch.equal(rank0["local"]["2.bias"], rank1["local"]["2.bias"])
    assert not torch.equal(rank0["local"]["0.weight"], rank1["local"]["0.weight"])
    assert rank0["losses"][-1] < rank0["losses"][0]


def test_data_parallel_without_fully_shard_is_refused(results: list[dict[str, Any]]) -> None:
    for check in _check(results, "dp2_without_fully_shard"):
        assert check["raised"] is not None
        assert "ModelParallelStrategy(data_parallel_size=2): parallelize_fn applied no fully_shard" in check["raised"]
