"""Lightning's subclass style on 2 real processes: MyFabric(strategy='ddp_spawn', devices=2).run(...)."""

from __future__ import annotations

import _it_runner as runner
import pytest

pytestmark = pytest.mark.multiprocess


def test_subclass_run_spawns_two_processes_and_returns_rank_zeros_result() -> None:
    run = runner.run_script("fabric_run_subclass.py", timeout=90)
    assert run.returncode == 0, run.output
    # all_reduce(sum) of (rank + 1) * 2 over ranks 0 and 1 is 6; rank 0's result comes back, plus the offset.
    assert "result (0, 7.0)" in run.stdout, run.output
