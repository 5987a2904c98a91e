"""A corpus of hand-written hostile pickles through every load path: nothing is imported, nothing runs.

Each pickle names a global (a shell call, a module that writes a file or ends the process when imported, a dotted
name that walks from an allowed module to os.system) through GLOBAL, STACK_GLOBAL, REDUCE, BUILD, INST, OBJ or
nested in containers. It is placed where a checkpoint's pickle lives (a plain file, a torch.save archive, a sharded
directory's `.metadata`, a DeepSpeed directory's model states) and loaded with the safe default by fabric.load,
fabric.load_raw, `fabric consolidate` and the consolidation utility. Every time: a clear refusal naming the global,
no new module in sys.modules, no file written, and the process still here.
"""

from __future__ import annotations

import pickle
import shutil
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import _hostile
import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.cli import main as cli_main
from fabric.utilities.load import _load_distributed_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:Detected pickle protocol")

REFUSED = "refused to load the checkpoint for safety"

# (module, name, argument) with `{marker}` replaced by a file the attack would create.
TARGETS = {
    "os.system": ("os", "system", "touch {marker}"),
    "module-writes-a-file": (_hostile.WRITER_MODULE, "run", "x"),
    "module-raises-SystemExit": (_hostile.EXIT_MODULE, "run", "x"),
    "dotted-from-allowed-module": ("torch", "os.system", "touch {marker}"),
    "dotted-from-metadata-module": ("torch.distributed.checkpoint.metadata", "os.system", "touch {marker}"),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


@pytest.fixture(scope="module")
def templates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Clean checkpoints of each layout; loading them once also imports what every load path imports lazily."""
    # Codecs load at first use: protocol 0 strings, and zip member names (read by a refusal's explanation).
    import encodings.cp437
    import encodings.raw_unicode_escape  # noqa: F401

    import torch.distributed.checkpoint as dcp

    from fabric.io import _pickle_scan  # noqa: F401 (imported by a refusal's explanation)

    root = tmp_path_factory.mktemp("templates")
    weights = _model().state_dict()
    sharded = root / "sharded"
    dcp.save({"model": weights, "step": 1}, storage_writer=dcp.FileSystemWriter(sharded), no_dist=True)
    deepspeed = root / "ds"
    (deepspeed / "checkpoint").mkdir(parents=True)
    (deepspeed / "latest").write_text("checkpoint")
    states = {"module": weights, "ds_config": {"zero_optimization": {"stage": 0}}, "dp_world_size": 1}
    torch.save(states, deepspeed / "checkpoint" / "mp_rank_00_model_states.pt")
    fabric = Fabric(accelerator="cpu", devices=1)
    fabric.load(sharded, {"model": _model()})
    fabric.load_raw(sharded, _model(), strict=False)
    fabric.load(deepspeed)
    assert cli_main(["consolidate", str(sharded), str(root / "out.pt")]) == 0
    assert cli_main(["consolidate", str(deepspeed), str(root / "out2.pt")]) == 0
    _load_distributed_checkpoint(sharded)
    return {"sharded": sharded, "deepspeed": deepspeed}


@pytest.fixture
def attack(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The side-effect modules importable from sys.path; yields the marker file no attack may create."""
    marker = tmp_path / "marker"
    modules = tmp_path / "modules"
    modules.mkdir()
    _hostile.write_side_effect_modules(modules, marker)
    monkeypatch.syspath_prepend(str(modules))
    yield marker
    for name in (_hostile.WRITER_MODULE, _hostile.EXIT_MODULE):
        sys.modules.pop(name, None)


def _place(layout: str, data: bytes, tmp_path: Path, templates: dict[str, Path]) -> Path:
    """A checkpoint of `layout` whose pickle is `data`."""
    if layout == "pickle-file":
        path = tmp_path / "evil.ckpt"
        path.write_bytes(data)
    elif layout == "torch-file":
        path = tmp_path / "evil.ckpt"
        path.write_bytes(_hostile.torch_file(data))
    elif layout == "sharded":
        path = tmp_path / "sharded"
        shutil.copytree(templates["sharded"], path)
        (path / ".metadata").write_bytes(data)
    else:
        path = tmp_path / "ds"
        shutil.copytree(templates["deepspeed"], path)
        (path / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(_hostile.torch_file(data))
    return path


def _calls(layout: str, tmp_path: Path) -> dict[str, Callable[[Path], Any]]:
    """Every public way to load a checkpoint of `layout`, each raising (or, for the CLI, printing) its error."""
    fabric = Fabric(accelerator="cpu", devices=1)
    calls: dict[str, Callable[[Path], Any]] = {
        "fabric.load": fabric.load,
        "fabric.load(state)": lambda path: fabric.load(path, {"model": _model()}),
        "fabric.load_raw": lambda path: fabric.load_raw(path, _model()),
    }
    if layout in ("sharded", "deepspeed"):
        calls["fabric consolidate"] = lambda path: _cli_consolidate(path, tmp_path / "out.pt")
    if layout == "sharded":
        calls["_load_distributed_checkpoint"] = _load_distributed_checkpoint
    return calls


class _CLIRefused(Exception):
    """What `fabric consolidate` printed when it exited with status 2."""


def _cli_consolidate(path: Path, output: Path) -> None:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = cli_main(["consolidate", str(path), str(output)])
    assert status == 2 and not output.exists(), (status, err.getvalue())
    raise _CLIRefused(err.getvalue())


@pytest.mark.parametrize("layout", ["pickle-file", "torch-file", "sharded", "deepspeed"])
@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("hostile", _hostile.CORPUS, ids=lambda h: h.kind)
def test_a_hostile_pickle_is_refused_without_importing_anything(
    hostile: _hostile.Hostile,
    target: str,
    layout: str,
    attack: Path,
    tmp_path: Path,
    templates: dict[str, Path],
) -> None:
    module, name, argument = TARGETS[target]
    path = _place(layout, hostile.build(module, name, argument.format(marker=attack)), tmp_path, templates)
    for call_name, call in _calls(layout, tmp_path).items():
        before = set(sys.modules)
        with pytest.raises((pickle.UnpicklingError, _CLIRefused)) as info:
            call(path)
        imported = set(sys.modules) - before
        assert not imported, f"{call_name} imported {sorted(imported)}"
        assert not attack.exists(), f"{call_name} ran the payload"
        message = str(info.value)
        assert REFUSED in message and f"{module}.{name}" in message and "weights_only=False" in message, (
            call_name,
            message,
        )
        # The error names the call the user made and the path they gave.
        op = "consolidate" if call_name in ("fabric consolidate", "_load_distributed_checkpoint") else "load"
        assert f"{op}({str(path)!r})" in message, (call_name, message)
