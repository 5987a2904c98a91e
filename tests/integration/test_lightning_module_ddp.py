"""A LightningModule trained by our Fabric with DDP on 2 real processes."""

from __future__ import annotations

import json
from pathlib import Path

import _it_runner as runner
import pytest

pytest.importorskip("lightning", reason="lightning is not installed (pip install torchfabric[lightning])")
pytestmark = pytest.mark.multiprocess


def test_lightning_module_logs_gathers_and_prints_under_ddp(tmp_path: Path) -> None:
    run = runner.run_script("lightning_module_ddp.py", str(tmp_path), timeout=120)
    assert run.returncode == 0, run.output
    assert run.stdout.count("training done") == 1, "self.print prints on global rank 0 only"
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert len(reports[0]["logged"]) == 3, "self.log reaches the logger on rank 0"
    assert reports[1]["logged"] == [], "loggers are written from rank 0 only"
    for report in reports:
        assert report["gathered"] == [0.0, 1.0], "self.all_gather collects from both ranks"
        assert report["replicas_equal"], "training_step did not run through DDP (gradients not averaged)"
        assert report["device"] == "cpu"
