"""Mistakes only several processes expose, caught on 2 real DDP ranks; a correct loop there gives no warning."""

from __future__ import annotations

import json
from pathlib import Path

import _it_runner as runner
import pytest

pytestmark = pytest.mark.multiprocess
JOB_TIMEOUT = 240


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One 2-rank job for both tests (each launch costs two interpreters); its output folder."""
    out = tmp_path_factory.mktemp("mistakes_ddp")
    run = runner.run_script("mistakes_ddp.py", str(out), timeout=JOB_TIMEOUT)
    assert run.returncode == 0, run.output
    return out


def test_a_ddp_model_freed_after_destroy_process_group_ends_the_job(job: Path) -> None:
    # The job got here: no rank hung freeing the model. And the model did hold the group's last reference, so the
    # hang's conditions were met (a gather in flight when the group went).
    for rank in (0, 1):
        assert json.loads((job / f"rank{rank}.end.json").read_text()) == {"group_freed_with_model": True}


def test_ddp_mistakes_are_named_and_a_correct_loop_stays_silent(job: Path) -> None:
    for rank in (0, 1):
        seen = json.loads((job / f"rank{rank}.json").read_text())
        # Lightning allows it (the gradients may be averaged by hand): a warning naming the drift, which happens.
        assert len(seen["backward_warnings"]) == 1
        assert seen["backward_warnings"][0].startswith(
            "fabric.backward(): no model was set up with this Fabric, but DDPStrategy runs 2 processes."
        )
        assert "Set the model up first" in seen["backward_warnings"][0]
        assert not seen["backward_grads_equal"], "this Fabric averaged gradients of a model it did not set up"
        assert len(seen["setup_warnings"]) == 1
        assert seen["setup_warnings"][0].startswith(
            "fabric.setup(Sequential, ..., SGD): 1 of the optimizer's parameters (shapes [1]) are not in the model. "
            "DDPStrategy averages only the model's gradients across the 2 processes"
        )
        # A correct loop (and inference on the original module under no_grad) warns about nothing, and trains
        # exactly as raw torch DDP does.
        assert seen["correct_warnings"] == []
        assert seen["correct_equal"] and seen["matches_raw_ddp"]
        # The guard on the original module costs the correct loop nothing: DDP called it with no hook in place.
        assert seen["hooks_in_wrapped_forward"] == [0, 0, 0]
        # Two training steps through the original module: one warning (once per Fabric), and the drift it names.
        assert len(seen["unwrapped_warnings"]) == 1
        assert seen["unwrapped_warnings"][0].startswith(
            "Sequential.forward() was called on the module you passed to fabric.setup(), not on the model "
            "fabric.setup() returned, while gradients are enabled. That call bypasses DDPStrategy"
        )
        assert not seen["unwrapped_equal"], "the replicas should have drifted apart, as the warning says"
