"""A second, single-process Fabric inside a running 2-rank process group (weight merging after a finetune)."""

from __future__ import annotations

import json
from pathlib import Path

import _it_runner as runner
import pytest

pytestmark = pytest.mark.multiprocess
JOB_TIMEOUT = 90


def test_single_process_fabric_inside_a_running_group_leaves_it_working(tmp_path: Path) -> None:
    run = runner.run_script("eg_second_fabric.py", str(tmp_path), timeout=JOB_TIMEOUT)
    assert run.returncode == 0, run.output
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (seen["strategy"], seen["world_size"], seen["global_rank"]) == ("SingleDeviceStrategy", 1, 0)
        assert seen["group_alive"], "the single-process Fabric tore the outer group down"
        assert seen["output_matches"], "save + load through the second Fabric changed the weights"
        assert seen["remainder"] == ["note"]
        assert seen["outer_sum"] == 3.0, "a collective on the outer group failed after the second Fabric"
        assert (tmp_path / f"merged-{rank}.pt").is_file()
        # The Fabric that created the group still destroys it at exit: a clean exit, no SIGABRT.
        assert json.loads((tmp_path / f"rank{rank}.exit.json").read_text()) == {"initialized": False}
