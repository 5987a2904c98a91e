"""A rank that never joins a collective: the other rank fails after DDPStrategy(timeout=...), saying what to change.

Each run (scripts/to_collective.py) gives the collective 3 s; rank 1 never joins and exits once rank 0 is done.
"""

from __future__ import annotations

import json
from pathlib import Path

import _it_runner as runner
import pytest
import torch.distributed as dist

from fabric.utilities.distributed import explain_timeout

TIMEOUT_SECONDS = 3
SLACK_SECONDS = 5  # the error must come within timeout + this, not after torch's 30-minute default
JOB_TIMEOUT = 45
FAILURE_TO_EXIT = 15  # torchrun: from the failing rank's exception until torchrun has exited


@pytest.mark.multiprocess
@pytest.mark.parametrize("ops", [("all_reduce", "all_gather"), ("barrier", "broadcast")])
def test_collective_times_out_with_explained_error(tmp_path: Path, ops: tuple[str, str]) -> None:
    # The first op runs on a fresh group, so its own timeout path is the one measured (gloo's barrier and
    # all_reduce both raise "Timed out waiting 3000ms"). After a timeout gloo closes the connections, so the
    # second op fails at once ("Application timeout caused pair closure"): only its message is checked.
    # broadcast and all_gather alone time out the same way (checked by hand); two runs keep the file fast.
    run = runner.run_script("to_collective.py", str(tmp_path), *ops, timeout=JOB_TIMEOUT)
    assert run.returncode == 0, run.output
    for index, op in enumerate(ops):
        result = json.loads((tmp_path / f"{op}.json").read_text())
        # torch's error, of torch's type (a user's `except DistBackendError` still matches), explained in a note.
        assert result["runtime_error"] and result["raised"] in ("RuntimeError", "DistBackendError"), result
        message = result["message"]
        # Collective #1 is the barrier both ranks passed; rank 0 then waits alone at #2 (and #3).
        assert message.startswith(f"fabric.{op}() at to_collective.py:"), result
        assert f"(collective #{2 + index})" in message, result
        assert "rank 1 has not arrived; its last collective was #1 barrier() at to_collective.py:" in message
        assert "and it is still running." in message, result
        if index == 0:
            assert "timed out after 0:00:03: rank 1" in message, result
            assert message.endswith("To wait longer, pass DDPStrategy(timeout=timedelta(minutes=...))."), result
            assert TIMEOUT_SECONDS - 0.5 < result["seconds"] < TIMEOUT_SECONDS + SLACK_SECONDS, result
            assert "Timed out" in result["error"], "torch's own error is what is raised"
        else:
            assert "failed at once: an earlier collective timed out" in message, result


def test_timeout_error_keeps_its_type_and_names_setting_in_a_note() -> None:
    original = dist.DistBackendError("[gloo/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation")
    with (
        pytest.raises(dist.DistBackendError) as info,
        explain_timeout("all_reduce", "0:00:03", "DDPStrategy(timeout=...)"),
    ):
        raise original
    assert info.value is original, "the user's `except DistBackendError` must still match"
    assert info.value.__notes__[-1].startswith(
        "fabric.all_reduce() timed out after 0:00:03 waiting for the other processes (DDPStrategy(timeout=...))."
    )


def test_timeout_of_a_group_fabric_did_not_create_points_to_init_process_group() -> None:
    setting = "torch.distributed.init_process_group(timeout=...)"
    with (
        pytest.raises(RuntimeError, match=r"Pass torch\.distributed\.init_process_group\(timeout=timedelta\(minutes"),
        explain_timeout("barrier", "the process group's timeout", setting),
    ):
        raise RuntimeError("Timed out waiting 1800000ms for recv operation to complete")


def test_other_collective_errors_pass_through_unchanged() -> None:
    with (
        pytest.raises(RuntimeError, match=r"^Connection closed by peer$"),
        explain_timeout("all_reduce", "0:00:03", "DDPStrategy(timeout=...)"),
    ):
        raise RuntimeError("Connection closed by peer")


@pytest.mark.multiprocess
def test_exception_under_torchrun_ends_the_job_in_bounded_time(tmp_path: Path) -> None:
    """torchrun's own behaviour (fabric starts nothing there): it ends the other rank and exits non-zero."""
    from fabric.environments.default import find_free_port

    args = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={find_free_port()}"]
    run = runner.run_python([*args, str(runner.SCRIPTS / "to_torchrun_raise.py"), str(tmp_path)], timeout=JOB_TIMEOUT)
    assert run.returncode != 0, run.output
    assert "integration-test-failure-5d2e: rank 1 raised under torchrun on purpose" in run.stderr, run.output
    failed_at = json.loads((tmp_path / "failed_at.json").read_text())["time"]
    assert run.finished_at - failed_at < FAILURE_TO_EXIT, run.output
    assert not (tmp_path / "rank0.unexpected.json").exists()
