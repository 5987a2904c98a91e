"""Uneven all_gather and exact evaluation (even_batches=False) on 2 real CPU ranks over gloo.

scripts/uneven_eval.py runs every check once and each rank saves what it observed; the tests below assert on both
ranks' observations.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest
import torch

pytestmark = pytest.mark.multiprocess
SIZES = (1001, 7, 1)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Both ranks' observations, from one run of the script for the whole module."""
    outdir = tmp_path_factory.mktemp("uneven")
    run = runner.run_script("uneven_eval.py", str(outdir), timeout=120)
    assert run.returncode == 0, run.output
    return [torch.load(outdir / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _check(observed: list[dict[str, Any]], name: str) -> list[Any]:
    """One check's result on rank 0 and rank 1, failing with the rank's traceback if the check raised."""
    results = [ranks[name] for ranks in observed]
    for rank, result in enumerate(results):
        if isinstance(result, dict) and isinstance(result.get("error"), str) and "Traceback" in result["error"]:
            pytest.fail(f"{name} raised on rank {rank}:\n{result['error']}")
    return results


def test_uneven_tensors_come_back_as_each_ranks_own_including_zero_rows(observed: list[dict[str, Any]]) -> None:
    for gathered in _check(observed, "gather_uneven_rows"):
        rows = gathered["rows"]
        assert isinstance(rows, list) and len(rows) == 2
        assert torch.equal(rows[0], torch.arange(6.0).view(3, 2))
        assert rows[1].shape == (0, 2) and rows[1].dtype == torch.float32
        cubes = gathered["inner"][0]
        assert torch.equal(cubes[0], torch.zeros(1, 2, 1, dtype=torch.int64))
        assert torch.equal(cubes[1], torch.ones(2, 2, 2, dtype=torch.int64))
        assert torch.equal(gathered["inner"][1], torch.tensor([5.0, 6.0])), "equal shapes in the same call stack"


def test_equal_shapes_keep_the_stacked_contract(observed: list[dict[str, Any]]) -> None:
    for gathered in _check(observed, "gather_equal_shapes"):
        assert torch.equal(gathered["x"], torch.stack([torch.zeros(2, 3), torch.ones(2, 3)]).long())


def test_uneven_gather_with_sync_grads_sends_each_rank_its_gradient(observed: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(_check(observed, "gather_uneven_sync_grads")):
        assert result["shapes"] == [(1,), (2,)]
        assert torch.equal(result["grad"], torch.full((rank + 1,), 2.0 * (rank + 1)))


def test_a_structure_mismatch_raises_on_both_ranks_and_nothing_hangs(observed: list[dict[str, Any]]) -> None:
    for result in _check(observed, "gather_mismatch"):
        assert result["error"] is not None
        assert "collections that do not match (tensors per rank: rank 0: 1, rank 1: 2" in result["error"]
        assert torch.equal(result["after"], torch.tensor(2.0)), "the next collective ran on both ranks"


@pytest.mark.parametrize("size", SIZES)
def test_exact_evaluation_gathers_every_sample_once(observed: list[dict[str, Any]], size: int) -> None:
    for rank, result in enumerate(_check(observed, "exact_evaluation")):
        exact, reference = result[size]["exact"], result[size]["reference"]
        assert sorted(exact["ids"].tolist()) == list(range(size)), "a sample was repeated or missing"
        assert exact["logits"].shape == (size, 3)
        # Same weights, same inputs; a batch of 8 and a batch of `size` may round a matmul differently.
        torch.testing.assert_close(exact["logits"][exact["ids"].argsort()], reference["logits"], rtol=0, atol=1e-6)
        assert int(exact["seen"]) == size
        assert int(exact["correct"]) == reference["correct"], "the metric differs from the single-process value"
        share = len(range(rank, size, 2))
        assert exact["batches"] == -(-share // 8), "len(loader) is this rank's exact number of batches"


@pytest.mark.parametrize("size", SIZES)
def test_the_default_still_pads_the_odd_sample(observed: list[dict[str, Any]], size: int) -> None:
    for result in _check(observed, "exact_evaluation"):
        padded = result[size]["padded"]
        assert int(padded["seen"]) == size + size % 2, "even_batches=True keeps today's padded DistributedSampler"
        assert len(padded["ids"]) == size + size % 2


def _complete_example(page: str) -> str:
    """The page's runnable example: its Python block with a __main__ guard."""
    text = (runner.SCRIPTS.parents[2] / "docs" / page).read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.DOTALL)
    return next(block for block in blocks if 'if __name__ == "__main__":' in block)


@pytest.mark.parametrize(("page", "printed"), [("uneven_gather.md", "(3, 2)"), ("exact_evaluation.md", "1001 samples")])
def test_the_docs_complete_examples_run_on_two_processes(tmp_path: Path, page: str, printed: str) -> None:
    script = tmp_path / page.replace(".md", ".py")
    script.write_text(_complete_example(page))
    run = runner.run_python([str(script)], timeout=120)
    assert run.returncode == 0, run.output
    assert printed in run.stdout, run.output
