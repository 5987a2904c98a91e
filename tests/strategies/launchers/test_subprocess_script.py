"""The `ddp` launcher starts each child through the worker entry, which ties the child's life to the launcher's,
instead of a `preexec_fn` (unsafe in a process that already runs threads)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fabric.strategies.launchers import _run_worker, subprocess_script
from fabric.strategies.launchers.subprocess_script import SubprocessScriptLauncher


def test_children_start_through_the_worker_entry_without_preexec_fn(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[tuple[list[str], dict[str, Any]]] = []

    def fake_popen(command: list[str], **kwargs: Any) -> Any:
        started.append((command, kwargs))
        return object()

    monkeypatch.setattr(subprocess_script.subprocess, "Popen", fake_popen)
    launcher = SubprocessScriptLauncher(2, 1, 0, "127.0.0.1", 12345)
    launcher._start(["python", "-m", _run_worker.MODULE, "train.py"], local_rank=1)
    ((command, kwargs),) = started
    assert command[-1] == "train.py"
    assert "preexec_fn" not in kwargs
    assert kwargs["env"][_run_worker.PARENT_PID_ENV] == str(os.getpid())
    assert kwargs["env"]["LOCAL_RANK"] == "1"


def test_the_script_command_runs_the_script_through_the_worker_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    import __main__

    monkeypatch.setattr(__main__, "__spec__", None, raising=False)
    monkeypatch.setattr(__main__, "__file__", __file__, raising=False)
    monkeypatch.setattr(sys, "argv", [__file__, "--lr", "0.1"])
    assert subprocess_script._script_command() == [
        sys.executable, "-m", _run_worker.MODULE, str(Path(__file__).resolve()), "--lr", "0.1"
    ]  # fmt: skip


def test_one_process_needs_no_script_file(monkeypatch: pytest.MonkeyPatch) -> None:
    # A notebook (no __main__.__file__) may run strategy='ddp' on one device: nothing is re-run.
    import __main__

    monkeypatch.setattr(__main__, "__spec__", None, raising=False)
    monkeypatch.delattr(__main__, "__file__", raising=False)
    launcher = SubprocessScriptLauncher(1, 1, 0, "127.0.0.1", 12345)
    assert launcher.launch(lambda x: x + 1, 41) == 42
    assert launcher.procs == []
    with pytest.raises(RuntimeError, match="this session has no script file"):
        SubprocessScriptLauncher(2, 1, 0, "127.0.0.1", 12345).launch(lambda: None)


def _worker_env() -> dict[str, str]:
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[3])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env[_run_worker.PARENT_PID_ENV] = str(os.getpid())
    return env


_REPORT = """
import json, os, sys
json.dump({"name": __name__, "argv": sys.argv[1:], "ppid": os.getppid()}, open(sys.argv[1], "w"))
"""


@pytest.mark.parametrize("as_module", [False, True])
def test_the_worker_entry_runs_a_script_or_a_module_as_main(tmp_path: Path, as_module: bool) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "report.py").write_text(_REPORT)
    out = tmp_path / "out.json"
    target = ["-m", "pkg.report"] if as_module else [str(tmp_path / "pkg" / "report.py")]
    subprocess.run(_run_worker.command([*target, str(out), "--x", "1"]), env=_worker_env(), cwd=tmp_path,
                   check=True, timeout=60)  # fmt: skip
    assert json.loads(out.read_text()) == {"name": "__main__", "argv": [str(out), "--x", "1"], "ppid": os.getpid()}


def test_the_worker_entry_asks_to_die_with_its_launcher(tmp_path: Path) -> None:
    out = tmp_path / "signal.txt"
    script = tmp_path / "read.py"
    # PR_GET_PDEATHSIG (2) reads the signal the worker entry asked for.
    script.write_text(
        "import ctypes, sys\n"
        "sig = ctypes.c_int()\n"
        "ctypes.CDLL('libc.so.6').prctl(2, ctypes.byref(sig))\n"
        "open(sys.argv[1], 'w').write(str(sig.value))\n"
    )
    if sys.platform != "linux":
        pytest.skip("the parent-death signal is a Linux feature")
    subprocess.run(_run_worker.command([str(script), str(out)]), env=_worker_env(), check=True, timeout=60)
    assert out.read_text() == "9"
