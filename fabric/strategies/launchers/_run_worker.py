"""Entry of every process `fabric run` starts: die with `fabric run`, then run the user's script as `__main__`.

torchrun starts its workers in sessions of their own and nothing ties them to it: SIGKILL of `fabric run` left
them training. Asking Linux here, before the script runs, closes that gap from the first line of the script.
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path

from fabric.strategies.launchers._process import die_with_parent

PARENT_PID_ENV = "FABRIC_RUN_PID"


def main() -> None:
    """`python -m fabric.strategies.launchers._run_worker SCRIPT [ARGS...]`, as `python SCRIPT [ARGS...]` would."""
    parent = os.environ.get(PARENT_PID_ENV)
    die_with_parent(int(parent) if parent else None)
    script = sys.argv[1]
    sys.argv = sys.argv[1:]
    sys.path[0] = str(Path(script).resolve().parent)  # `python SCRIPT` puts the script's folder first
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
