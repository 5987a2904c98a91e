"""Preemption and exact resume together on 2 real ranks (issue 18): wherever the loop reads fabric.preempted, at the
top of its body (docs/preemption.md) or after optimizer.step(), the resumed run ends with the weights of the
uninterrupted run, bit for bit, having trained on exactly the batches the stopped run did not.

scripts/preempt_resume.py (a shuffled loader with 2 workers per rank): rank 0 gets SIGTERM after step 4; both ranks
save at the same check and exit 0.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest
import torch

pytestmark = pytest.mark.multiprocess
pytest.importorskip("torchdata", reason="torchdata is not installed (pip install torchfabric[resume])")


def _run(outdir: Path, phase: str) -> None:
    run = runner.run_script("preempt_resume.py", str(outdir), phase, timeout=240)
    assert run.returncode == 0, run.output


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    outdir = tmp_path_factory.mktemp("preempt_resume")
    _run(outdir, "stop-top")
    _run(outdir, "stop-after")
    _run(outdir, "resume")
    return outdir


def _result(outdir: Path, run: str, rank: int) -> dict[str, Any]:
    result = torch.load(outdir / f"{run}_rank{rank}.pt", weights_only=False)
    if "error" in result:
        pytest.fail(f"{run} raised on rank {rank}:\n{result['error']}")
    return result


@pytest.mark.parametrize("placement", ["top", "after"])
@pytest.mark.parametrize("rank", [0, 1])
def test_preempted_and_resumed_run_equals_the_uninterrupted_one(runs: Path, placement: str, rank: int) -> None:
    full = _result(runs, "full-none", rank)
    stopped = _result(runs, f"stop-{placement}", rank)
    resumed = _result(runs, f"resume-{placement}", rank)
    assert 4 <= stopped["step"] < full["step"], "the signal stopped the run before its end"
    assert stopped["seen"] + resumed["seen"] == full["seen"], "a batch was lost or repeated across the resume"
    assert resumed["step"] == full["step"]
    for key, value in full["weights"].items():
        assert torch.equal(value, resumed["weights"][key]), f"{placement} rank {rank}: {key} differs"
