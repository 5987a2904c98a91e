"""Launching from an interactive session, where __main__ is no script a child could re-run.

The session's code (scripts/nb_launch.py) is piped to `python -` (which sets __file__ to "<stdin>") or
`python -i -` (a REPL reading stdin), the way a notebook kernel runs typed code.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable

import _it_runner as runner
import pytest
import torch

from fabric.strategies.launchers import multiprocessing as mp_launcher

SESSION_TIMEOUT = 60
NO_SCRIPT_ERROR = (
    "ERROR Fabric(strategy='ddp').launch(): this strategy re-runs your script in new processes, but this session "
    "has no script file (a notebook or an interactive shell). Use strategy='ddp_notebook' (or 'ddp_spawn') and "
    "pass a function to fabric.launch(fn)."
)


def _session(flags: list[str], strategies: list[str]) -> str:
    """Run nb_launch.py as typed code in a new session with a hard timeout; its stdout."""
    code = (runner.SCRIPTS / "nb_launch.py").read_text()
    proc = subprocess.Popen(
        [sys.executable, *flags, "-", *strategies],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=runner.script_env(),
        cwd=runner.SCRIPTS,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(code, timeout=SESSION_TIMEOUT)
    except subprocess.TimeoutExpired:
        runner.end_group(proc.pid)
        stdout, stderr = proc.communicate()
        pytest.fail(f"the session did not finish within {SESSION_TIMEOUT} s\n{stdout}\n{stderr}")
    finally:
        runner.end_group(proc.pid)
    assert proc.returncode == 0, f"{stdout}\n{stderr}"
    return stdout


@pytest.fixture(scope="module")
def sessions() -> Callable[[list[str], str], str]:
    """What a session printed for one strategy. The user who is told to use ddp_notebook does so in the same
    session: one session tries ddp (which starts no process), then ddp_notebook, and serves both tests (each
    session costs an interpreter that imports torch)."""
    outputs: dict[tuple[str, ...], dict[str, str]] = {}

    def output(flags: list[str], strategy: str) -> str:
        strategies = ["ddp", "ddp_notebook"] if strategy in ("ddp", "ddp_notebook") else [strategy]
        key = (*flags, *strategies)
        if key not in outputs:
            parts = re.split(r"^STRATEGY ", _session(flags, strategies), flags=re.MULTILINE)[1:]
            outputs[key] = {part.split("\n", 1)[0]: part for part in parts}
        assert strategy in outputs[key], outputs[key]
        return outputs[key][strategy]

    return output


@pytest.mark.multiprocess
@pytest.mark.parametrize("flags", [[], ["-i"]], ids=["stdin", "interactive"])
@pytest.mark.parametrize("strategy", ["ddp_notebook", "ddp_fork"])
def test_fork_strategies_run_a_function_defined_in_the_session(
    sessions: Callable[[list[str], str], str], flags: list[str], strategy: str
) -> None:
    out = sessions(flags, strategy)
    assert "RESULT 3.0 2 True" in out, out  # 1 + 2 summed over 2 workers, returned from a worker to the session


@pytest.mark.multiprocess
@pytest.mark.parametrize("flags", [[], ["-i"]], ids=["stdin", "interactive"])
def test_ddp_from_a_session_without_script_says_to_use_ddp_notebook(
    sessions: Callable[[list[str], str], str], flags: list[str]
) -> None:
    out = sessions(flags, "ddp")
    assert NO_SCRIPT_ERROR in out, out
    assert "RESULT" not in out


def test_fork_after_cuda_was_initialised_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    launcher = mp_launcher.MultiProcessingLauncher(2, 1, 0, "127.0.0.1", 0, start_method="fork")
    with pytest.raises(
        RuntimeError,
        match=r"Fabric\(strategy='ddp_fork'/'ddp_notebook'\)\.launch\(\): CUDA was already initialised in this "
        r"process, and a forked process cannot use CUDA after that\. .* or use strategy='ddp_spawn'\.",
    ):
        launcher.launch(print)
