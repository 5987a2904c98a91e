"""The Lightning-named helpers on two real CPU processes (gloo): ranks, collectives, shared file system, throughput."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parent / "scripts" / "compat_ranks.py"

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("no_cluster_env")]


def test_helpers_know_their_rank_and_communicate_on_two_processes(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=180, env=env
    )
    assert result.returncode == 0, result.stderr
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert report["global_rank"] == report["rank_zero_only_rank"] == rank
        assert report["rank_zero_only_ran"] is (rank == 0)
        assert report["collectives"] == {
            "rank": rank, "world_size": 2, "sum": 3.0, "broadcast": 15.0, "gathered": [0.0, 1.0],
            "objects": [{"rank": 0}, {"rank": 1}], "own_max": 1.0, "own_size": 2,
        }  # fmt: skip
        assert report["shared_fs"] is True  # both processes run on this machine
    # rank 0 computes over a world of 2 (global rates are the device rates times 2); rank 1 gets nothing
    assert reports[0]["throughput"] == {
        "time": 2.0, "batches": 2, "samples": 8,
        "device/batches_per_sec": 1.0, "device/samples_per_sec": 4.0, "batches_per_sec": 2.0, "samples_per_sec": 8.0,
    }  # fmt: skip
    assert reports[1]["throughput"] == {}
    assert not list(tmp_path.glob(".fabric_shared_fs_check")), "the marker file is removed"
