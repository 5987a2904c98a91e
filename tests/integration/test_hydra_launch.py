"""A Hydra app launched on 2 ranks by fabric.launch(): the children join the parent's run, as in Lightning."""

from __future__ import annotations

import json
from pathlib import Path

import _it_runner as runner
import pytest

pytestmark = pytest.mark.multiprocess


def test_children_of_a_hydra_app_share_its_run_directory_and_print_no_config(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    run = runner.run_script("hydra_app.py", f"hydra.run.dir={runs}/" + "${now:%H-%M-%S-%f}", "lr=0.5", timeout=90)
    assert run.returncode == 0, run.output
    [run_dir] = list(runs.iterdir())  # exactly one run directory: the children made none of their own
    reports = [json.loads((run_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [r["lr"] for r in reports] == [0.5, 0.5], "the children got the command's overrides"
    assert [r["job"] for r in reports] == ["hydra_app", "train_ddp_process_1"]  # each rank logs to its own file
    assert reports[0]["cwd"] == reports[1]["cwd"]
    assert run.output.count("CONFIG lr: 0.5") == 1, run.output
    assert sorted(p.name for p in (run_dir / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
