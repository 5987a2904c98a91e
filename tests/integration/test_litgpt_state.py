"""litgpt's checkpoint state on 2 gloo ranks: the set-up loader inside the state saves and resumes its position with
the default install, and without torchdata it is saved as Lightning Fabric saves it (whole), with a warning.

scripts/litgpt_state.py takes 3 steps, saves {"model", "optimizer", "train_dataloader", "iter_num": 3}, takes 3 more,
then loads the checkpoint into a fresh state in the same processes and takes 3 steps from there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import _it_runner as runner
import pytest

pytestmark = pytest.mark.multiprocess


def _ranks(outdir: Path, mode: str) -> list[dict[str, Any]]:
    run = runner.run_script("litgpt_state.py", str(outdir), "2", mode, timeout=180)
    assert run.returncode == 0, run.output
    results = [json.loads((outdir / f"rank{rank}.json").read_text()) for rank in range(2)]
    for result in results:
        assert "error" not in result, result["error"]
    return results


def test_litgpt_state_resumes_at_the_next_batch_on_each_rank(tmp_path: Path) -> None:
    results = _ranks(tmp_path, "stateful")
    assert results[0]["before"] != results[1]["before"], "each rank reads its own shard"
    for result in results:
        assert result["resumed"] == result["after"], "the resumed loader continues with the next batch"
        assert result["iter_num"] == 3 and result["same_loader"]
        assert result["warnings"] == []
        assert not result["imported_torchdata"], "import fabric does not import torchdata"


def test_without_torchdata_litgpt_state_saves_and_loads_as_in_lightning(tmp_path: Path) -> None:
    results = _ranks(tmp_path, "no-torchdata")
    for result in results:
        assert result["iter_num"] == 3 and result["same_loader"]
        assert result["resumed"] == result["before"], "without a saved position the epoch starts afresh"
        assert len(result["warnings"]) == 1
        assert "torchdata is not installed, so the loader's position in its epoch is not saved" in result["warnings"][0]
