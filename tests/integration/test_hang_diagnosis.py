"""A rank that hangs, leaves early, is killed, or issues another collective: the others' error says who and where.

Each test starts the two ranks of scripts/diag_job.py by hand (torchrun's variables, no launcher), so the error is
the waiting rank's own, not a launcher's summary, and ends the whole job in a `finally`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import _it_runner as runner
import pytest

from fabric.environments.default import find_free_port

SCRIPT = runner.SCRIPTS / "diag_job.py"
JOB_TIMEOUT = 60  # generous: two ranks on a loaded 2-core machine; the collective timeout itself is 3 s


@dataclass
class Rank:
    """One finished (or killed) rank: its exit code and what it printed."""

    pid: int
    returncode: int | None
    output: str


def _line(marker: str) -> int:
    """The line of diag_job.py that holds `marker` (call sites in the messages are checked against it)."""
    lines = [n for n, text in enumerate(SCRIPT.read_text().splitlines(), start=1) if marker in text]
    assert len(lines) == 1, (marker, lines)
    return lines[0]


BARRIER = _line("fabric.barrier()  # collective #1")
SLEEP_REDUCE = _line("rank 1 waits here")
LOOP_REDUCE = _line("collectives #2, #3")
KILL_REDUCE = _line("rank 0 waits here")
SETUP = _line("collective #2 (DDP broadcasts")
BACKWARD = _line("collective #3: rank 1 waits")


def _run_job(tmp_path: Path, case: str, wait_for: tuple[int, ...], debug: bool = False) -> dict[int, Rank]:
    """Start each rank in a new session; wait until the ranks in `wait_for` exit, then end both sessions."""
    env = runner.script_env()
    env.pop("FABRIC_DEBUG_COLLECTIVES", None)
    common = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_port()), "WORLD_SIZE": "2"}
    common |= {"LOCAL_WORLD_SIZE": "2", "FABRIC_DEBUG_COLLECTIVES": "1" if debug else "0"}
    procs: list[subprocess.Popen] = []
    logs = [tmp_path / f"rank{rank}.log" for rank in range(2)]
    try:
        for rank in range(2):
            with logs[rank].open("w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, str(SCRIPT), str(tmp_path), case],
                        env={**env, **common, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        cwd=runner.SCRIPTS,
                        start_new_session=True,  # so that ending the session ends anything the rank started
                    )
                )
        deadline = time.monotonic() + JOB_TIMEOUT
        while any(procs[rank].poll() is None for rank in wait_for) and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        codes = [proc.poll() for proc in procs]
        for proc in procs:
            _end_session(proc.pid)
        for proc in procs:
            proc.wait(timeout=10)
    assert not runner.wait_gone([proc.pid for proc in procs], 5), "a rank outlived the job"
    ranks = {rank: Rank(proc.pid, codes[rank], logs[rank].read_text()) for rank, proc in enumerate(procs)}
    for rank in wait_for:
        assert ranks[rank].returncode is not None, f"rank {rank} did not end in {JOB_TIMEOUT} s:\n{ranks[rank].output}"
    return ranks


def _end_session(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def _message(rank: Rank, start: str) -> str:
    """The one line of the rank's output that holds fabric's explanation: a note under torch's own error (torch
    prefixes each line with `[rankN]: `)."""
    found = [line.split(": ", 1)[1] for line in rank.output.splitlines() if line.split(": ", 1)[-1].startswith(start)]
    assert len(found) == 1, rank.output
    return found[0]


@pytest.mark.multiprocess
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug-mode"])
def test_sleeping_rank_is_named_not_the_waiting_one(tmp_path: Path, debug: bool) -> None:
    # In debug mode rank 1 waits in the cross-rank comparison instead of gloo: the same diagnosis.
    ranks = _run_job(tmp_path, "sleep", wait_for=(1,), debug=debug)
    assert ranks[1].returncode == 1, ranks[1].output
    message = _message(ranks[1], "fabric.all_reduce()")
    assert message == (
        f"fabric.all_reduce() at diag_job.py:{SLEEP_REDUCE} (collective #2) timed out after 0:00:03: "
        f"rank 0 has not arrived; its last collective was #1 barrier() at diag_job.py:{BARRIER} and it is still "
        "running. To wait longer, pass DDPStrategy(timeout=timedelta(minutes=...))."
    )
    if not debug:
        assert "Timed out waiting 3000ms" in ranks[1].output, "gloo's own error is the one raised"


@pytest.mark.multiprocess
def test_rank_with_one_iteration_fewer_has_exited(tmp_path: Path) -> None:
    ranks = _run_job(tmp_path, "fewer", wait_for=(0, 1))
    assert ranks[1].returncode == 0, ranks[1].output
    assert ranks[0].returncode == 1, ranks[0].output
    message = _message(ranks[0], "fabric.all_reduce()")
    # gloo reports a peer that closed its connections at once, or as a timeout if the close went unnoticed.
    assert message.startswith(f"fabric.all_reduce() at diag_job.py:{LOOP_REDUCE} (collective #4) ")
    assert (
        f": rank 1 has not arrived; its last collective was #3 all_reduce() at diag_job.py:{LOOP_REDUCE} and it has "
        "exited (its script ended)."
    ) in message


@pytest.mark.multiprocess
def test_killed_rank_is_no_longer_running(tmp_path: Path) -> None:
    ranks = _run_job(tmp_path, "kill", wait_for=(0, 1))
    assert ranks[1].returncode == -signal.SIGKILL, ranks[1].output
    assert ranks[0].returncode == 1, ranks[0].output
    message = _message(ranks[0], "fabric.all_reduce()")
    assert message.startswith(f"fabric.all_reduce() at diag_job.py:{KILL_REDUCE} (collective #2) ")
    # No pid is probed: its heartbeat stopped, as rank 0 saw on its own clock.
    assert re.search(
        rf": rank 1 has not arrived; its last collective was #1 barrier\(\) at diag_job\.py:{BARRIER} and it gave no "
        r"sign of life for \d+ s as seen from this rank",
        message,
    ), message


@pytest.mark.multiprocess
def test_timeout_inside_ddp_backward_gets_the_same_diagnosis(tmp_path: Path) -> None:
    ranks = _run_job(tmp_path, "backward", wait_for=(1,))
    assert ranks[1].returncode == 1, ranks[1].output
    message = _message(ranks[1], "fabric.backward()")
    assert message == (
        f"fabric.backward() at diag_job.py:{BACKWARD} (collective #3) timed out after 0:00:03: "
        f"rank 0 has not arrived; its last collective was #2 setup() at diag_job.py:{SETUP} and it is still "
        "running. To wait longer, pass DDPStrategy(timeout=timedelta(minutes=...))."
    )


@pytest.mark.multiprocess
def test_a_rank_stuck_inside_its_backward_is_seen_there(tmp_path: Path) -> None:
    # fabric.backward only counts a backward; the other rank learns it is inside it from its job-health thread,
    # which finds it in the stuck rank's stack (the user's line included).
    ranks = _run_job(tmp_path, "inside", wait_for=(1,))
    assert ranks[1].returncode == 1, ranks[1].output
    message = _message(ranks[1], "fabric.all_reduce()")
    assert message == (
        f"fabric.all_reduce() at diag_job.py:{_line('collective #3 on rank 1')} (collective #3) timed out after "
        f"0:00:03: rank 0 is at #3 backward() at diag_job.py:{_line('collective #3 on rank 0')} instead, so the "
        "ranks' collectives diverged (FABRIC_DEBUG_COLLECTIVES=1 stops at the first difference) and it is still "
        "running. To wait longer, pass DDPStrategy(timeout=timedelta(minutes=...))."
    )


_SHAPE, _DTYPE, _GATHER = _line("mismatch: shape"), _line("mismatch: dtype"), _line("mismatch: gather shape")
_MISMATCHES = {
    "op": f"rank 0 calls all_reduce(float32[2], mean) at diag_job.py:{_line('mismatch: op, rank 0')}; "
    f"rank 1 calls barrier() at diag_job.py:{_line('mismatch: op, rank 1')}",
    "shape": f"rank 0 calls all_reduce(float32[2, 3], mean) at diag_job.py:{_SHAPE}; "
    f"rank 1 calls all_reduce(float32[3, 3], mean) at diag_job.py:{_SHAPE}",
    "dtype": f"rank 0 calls all_reduce(float32[2], mean) at diag_job.py:{_DTYPE}; "
    f"rank 1 calls all_reduce(float64[2], mean) at diag_job.py:{_DTYPE}",
    # Raw torch gives garbage on one rank and aborts the other here (gloo): debug mode names the opt-in instead.
    "gather": f"rank 0 calls all_gather(float32[2, 3]) at diag_job.py:{_GATHER}; "
    f"rank 1 calls all_gather(float32[1, 3]) at diag_job.py:{_GATHER}",
}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", sorted(_MISMATCHES))
def test_debug_mode_raises_on_every_rank_with_both_call_sites(tmp_path: Path, case: str) -> None:
    ranks = _run_job(tmp_path, case, wait_for=(0, 1), debug=True)
    expected = (
        f"FABRIC_DEBUG_COLLECTIVES: the ranks issue different collectives as collective #2: {_MISMATCHES[case]}. "
        "Every rank must issue the same collectives in the same order"
    )
    for rank in ranks.values():
        assert rank.returncode == 1, rank.output
        assert f"CollectiveMismatchError: {expected}" in rank.output, rank.output
        assert ("call fabric.all_gather(data, uneven=True)" in rank.output) == (case == "gather"), rank.output


@pytest.mark.multiprocess
def test_debug_mode_lets_matching_collectives_through(tmp_path: Path) -> None:
    ranks = _run_job(tmp_path, "agree", wait_for=(0, 1), debug=True)
    for rank in ranks.values():
        assert rank.returncode == 0, rank.output
    results = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert results[0] == results[1]
    # DDP averaged the gradients of inputs 0 and 1: d/dw sum(x @ w) = 3 * x per rank -> mean 1.5.
    assert results[0] == {"sum": [2.0, 1.0], "a": [0, 1], "b": [3, 3], "sent": {"step": 7}, "grad": [[1.5, 1.5]]}
