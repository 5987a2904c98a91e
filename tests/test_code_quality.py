"""ruff and mypy are part of the test command, so a lint or type error fails CI like a broken test."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.skipif(shutil.which("ruff") is None and not (Path(sys.executable).parent / "ruff").exists(),
                    reason="ruff is not installed (pip install torchfabric[test])")  # fmt: skip
def test_ruff_clean() -> None:
    ruff = str(Path(sys.executable).parent / "ruff") if (Path(sys.executable).parent / "ruff").exists() else "ruff"
    for command in ([ruff, "check", "."], [ruff, "format", "--check", "."]):
        result = _run(*command)
        assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_clean() -> None:
    pytest.importorskip("mypy", reason="mypy is not installed (pip install torchfabric[test])")
    result = _run(sys.executable, "-m", "mypy")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success" in result.stdout


def test_import_does_not_load_optional_heavy_packages() -> None:
    code = (
        "import sys, fabric\n"
        "heavy = ('deepspeed', 'torch_xla', 'tensorboard', 'torch._dynamo', 'lightning', 'accelerate',\n"
        "         'bitsandbytes', 'transformer_engine', 'fairscale', 'matplotlib', 's3fs', 'moto')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy or m.startswith('torch._dynamo')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
