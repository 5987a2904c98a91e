"""On 2 real DDP ranks, what Lightning Fabric allows runs in fabric too, and trains as raw torch DDP does: a second
Fabric with a SingleDeviceStrategy inside the running group, backward with no model set up by that Fabric (gradients
averaged by hand, as sheeprl does), and the original module set up a second time with its optimizer."""

from __future__ import annotations

import json
from pathlib import Path

import _it_runner as runner
import pytest

pytestmark = pytest.mark.multiprocess
JOB_TIMEOUT = 150


def test_lightning_allowed_forms_run_and_train_like_raw_ddp(tmp_path: Path) -> None:
    run = runner.run_script("lightning_allows_ddp.py", str(tmp_path), timeout=JOB_TIMEOUT)
    assert run.returncode == 0, run.output
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # The player Fabric is a single-device Fabric beside the group: rank 0 of 1, local collectives, no thread.
        assert seen["player"] == ["SingleDeviceStrategy", 1, 0, float(rank + 1)]
        assert seen["player_new_threads"] == 0, "the player Fabric started a thread (health, recorder) on the group"
        assert seen["group_alive"]
        assert len(seen["player_backward_warnings"]) == 1, "warned once for two backward calls"
        assert seen["player_backward_warnings"][0].startswith(
            "fabric.backward(): no model was set up with this Fabric, but DDPStrategy runs 2 processes. "
            "This Fabric does not average the gradients of a model it did not set up"
        )
        assert seen["player_matches_raw_ddp"], "gradients averaged by hand should train as DDP does"
        # The original module set up again: a warning, and both wrappers keep the replicas in sync.
        assert seen["twice_first_warnings"] == []
        assert len(seen["twice_warnings"]) == 1
        assert seen["twice_warnings"][0].startswith(
            "fabric.setup(Sequential): this module was already set up by this Fabric, and is now wrapped a second "
            "time, as Lightning Fabric does."
        )
        assert seen["twice_matches_raw_ddp"] and seen["twice_equal"]
        assert seen["outer_sum"] == 3.0, "the DDP Fabric's collectives failed after the player Fabric"
        # The Fabric that created the group still destroys it at exit: a clean exit, no SIGABRT.
        assert json.loads((tmp_path / f"rank{rank}.exit.json").read_text()) == {"initialized": False}
