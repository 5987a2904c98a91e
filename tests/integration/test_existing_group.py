"""Fabric inside a program that initialised torch.distributed itself: it uses that group and never destroys it."""

from __future__ import annotations

import json
from pathlib import Path

import _it_runner as runner
import pytest

pytestmark = pytest.mark.multiprocess
JOB_TIMEOUT = 60


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def test_library_creates_and_drops_two_fabrics_in_its_own_group(tmp_path: Path) -> None:
    run = runner.run_script("eg_library.py", str(tmp_path), timeout=JOB_TIMEOUT)
    assert run.returncode == 0, run.output
    for rank in (0, 1):
        result = _read(tmp_path / f"rank{rank}.json")
        for seen in (result["first"], result["second"]):
            assert seen["strategy"] == "DDPStrategy", "strategy='auto' in a group of 2 is DDP"
            assert seen["environment"] == "ProcessGroupEnvironment"
            assert (seen["world_size"], seen["global_rank"], seen["local_rank"]) == (2, rank, rank)
            assert seen["sum"] == 3.0  # 1 + 2: the all_reduce ran over the library's group
        assert result["group_alive"], "a Fabric destroyed a process group it did not create"


def test_fabric_that_created_the_group_destroys_it_at_exit_and_a_second_fabric_reuses_it(tmp_path: Path) -> None:
    run = runner.run_script("eg_owner.py", str(tmp_path), timeout=JOB_TIMEOUT)
    assert run.returncode == 0, run.output
    for rank in (0, 1):
        seen = _read(tmp_path / f"rank{rank}.json")
        assert seen["environment"] == "ProcessGroupEnvironment"
        assert (seen["strategy"], seen["world_size"], seen["global_rank"], seen["sum"]) == ("DDPStrategy", 2, rank, 2.0)
        assert seen["alive_after_guest"], "the second Fabric destroyed the first one's group"
        assert _read(tmp_path / f"rank{rank}.exit.json") == {"initialized": False}, "the owner left its group alive"
