"""The Hydra overrides a child of fabric.launch() gets (the real 2-rank run is in tests/integration)."""

from __future__ import annotations

import subprocess
import sys

from fabric.strategies.launchers import _hydra


def test_a_script_without_hydra_gets_no_overrides_and_hydra_is_never_imported() -> None:
    code = "import sys; from fabric.strategies.launchers import _hydra; "
    code += "print(_hydra.child_overrides(1), 'hydra' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "([], None) False"


def test_hydra_imported_but_no_app_running_gets_no_overrides() -> None:
    import hydra  # noqa: F401  (imported, but no @hydra.main is running)

    assert _hydra.child_overrides(1) == ([], None)
