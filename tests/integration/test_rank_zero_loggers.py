"""The built-in loggers write on global rank 0 only, as Lightning Fabric's do (2 gloo ranks; see the script)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import _it_runner as runner
import pytest

pytestmark = pytest.mark.multiprocess
pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install torchfabric[tensorboard])")


def test_only_rank_zero_creates_a_version_and_writes(tmp_path: Path) -> None:
    run = runner.run_script("rank_zero_loggers.py", str(tmp_path), timeout=180)
    assert run.returncode == 0, run.output
    rank0, rank1 = (json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2))
    for result in (rank0, rank1):
        assert "error" not in result, result["error"]
    assert rank1["files_after_own_calls"] == [], "rank 1 created no directory and wrote nothing"
    assert rank1["tb_experiment"] == rank1["csv_experiment"] == "_DummyExperiment"
    assert set(rank1["returned"]) == {"None"}
    assert rank0["tb_experiment"] == "SummaryWriter"
    assert sorted({Path(f).parts[:2] for f in rank0["files_after_own_calls"]}) == [
        ("csv", "version_0"),
        ("tb", "version_0"),
    ]
    events = [f for f in rank0["files_after_own_calls"] if "tfevents" in f]
    assert len(events) == 1, "one writer: rank 0's"
    with (tmp_path / "logs" / "csv" / "version_0" / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert [row["loss"] for row in rows if row["loss"]] == ["1.0"], "fabric.log from rank 0 only"
    assert [row["via_experiment"] for row in rows if row["via_experiment"]] == ["4.0"]
    assert json.loads((tmp_path / "logs" / "csv" / "version_0" / "hparams.json").read_text()) == {"lr": 0.1}
