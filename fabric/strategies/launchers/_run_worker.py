"""Entry of every process a fabric launcher re-runs the script in: die with the launcher, then run the user's
script (or `-m module`) as `__main__`.

torchrun starts its workers in sessions of their own and nothing ties them to it: SIGKILL of `fabric run` left
them training. Asking Linux here, before the script runs, closes that gap from the first line of the script, and
without `Popen(preexec_fn=...)`, which is unsafe in a process that runs threads (the `ddp` launcher's rank 0).
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from fabric.strategies.launchers._process import die_with_parent, record_finished

PARENT_PID_ENV = "FABRIC_RUN_PID"  # launcher-private: the pid of the launcher this process must die with
LAUNCHED_RANK_ENV = "FABRIC_LAUNCHED_RANK"  # launcher-private: the global rank fabric.launch() gave this child
MODULE = "fabric.strategies.launchers._run_worker"


def command(target: list[str]) -> list[str]:
    """The interpreter command that runs `target` (SCRIPT [ARGS...] or -m MODULE [ARGS...]) through this entry."""
    return [sys.executable, "-m", MODULE, *target]


def main() -> None:
    """`python -m fabric.strategies.launchers._run_worker SCRIPT [ARGS...]`, as `python SCRIPT [ARGS...]` would;
    `... _run_worker -m MODULE [ARGS...]` as `python -m MODULE [ARGS...]` would."""
    parent = os.environ.get(PARENT_PID_ENV)
    die_with_parent(int(parent) if parent else None)
    try:
        _run(sys.argv[1:])
    except SystemExit:
        record_finished()
        raise
    record_finished()


def _run(target: list[str]) -> None:
    if target[0] == "-m":
        sys.argv = target[1:]  # run_module(alter_sys=True) sets argv[0] to the module's file
        runpy.run_module(target[1], run_name="__main__", alter_sys=True)
        return
    script = target[0]
    sys.argv = target
    sys.path[0] = str(Path(script).resolve().parent)  # `python SCRIPT` puts the script's folder first
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
