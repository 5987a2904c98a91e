"""What the safe load refuses besides code-running pickles, and how it says so.

Storage paths in `.metadata` and DeepSpeed's `latest` tag stay inside the checkpoint directory; a pickle that the
weights-only loader cannot read but that is intact is not called corrupt; refusals name the call the user made;
`weights_only` is a bool; no exception type chosen by a file ends the process.
"""

from __future__ import annotations

import dataclasses
import pickle
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import _hostile
import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.checkpoint import safe
from fabric.cli import main as cli_main
from fabric.io._load import UnsafeCheckpointError

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled", "ignore:Detected pickle protocol")


def _fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _sharded(tmp_path: Path) -> Path:
    import torch.distributed.checkpoint as dcp

    directory = tmp_path / "sharded"
    dcp.save({"model": _model().state_dict(), "step": 1}, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    return directory


def _deepspeed(tmp_path: Path, name: str = "ds", **save_args: Any) -> Path:
    """The layout DeepSpeed writes for ZeRO stage 0 (full weights in the model-states file)."""
    directory = tmp_path / name
    (directory / "checkpoint").mkdir(parents=True)
    (directory / "latest").write_text("checkpoint")
    states = {"module": _model().state_dict(), "ds_config": {"zero_optimization": {"stage": 0}}, "dp_world_size": 1}
    torch.save(states, directory / "checkpoint" / "mp_rank_00_model_states.pt", **save_args)
    return directory


def _point_storage_at(directory: Path, relative_path: str) -> None:
    """Rewrite `.metadata` (a file we wrote, so plain pickle is fine) so that every shard lives at `relative_path`."""
    metadata_file = directory / ".metadata"
    metadata = pickle.loads(metadata_file.read_bytes())
    metadata.storage_data = {
        key: dataclasses.replace(info, relative_path=relative_path) for key, info in metadata.storage_data.items()
    }
    metadata_file.write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("escape", ["../outside.distcp", "{absolute}", "nested/__0_0.distcp", "..", "a\\b.distcp"])
def test_storage_paths_outside_the_directory_are_refused(tmp_path: Path, escape: str) -> None:
    directory = _sharded(tmp_path)
    # The file the crafted metadata points to exists, so only the path rule can stop the read.
    outside = tmp_path / "outside.distcp"
    shutil.copy(next(directory.glob("*.distcp")), outside)
    (directory / "nested").mkdir()
    shutil.copy(outside, directory / "nested" / "__0_0.distcp")
    name = escape.format(absolute=outside)
    _point_storage_at(directory, name)
    pattern = rf"names the storage file {re.escape(repr(name))}, which is not a file inside the checkpoint directory"

    for weights_only in (None, False):  # a path rule, not a pickle rule: trusting the pickle does not lift it
        with pytest.raises(ValueError, match=r"load\(.*" + pattern):
            _fabric().load(directory, weights_only=weights_only)
        with pytest.raises(ValueError, match=pattern):
            _fabric().load(directory, {"model": _model()}, weights_only=weights_only)
    output = tmp_path / "out.pt"
    assert cli_main(["consolidate", str(directory), str(output)]) == 2
    assert not output.exists()


def test_the_dcp_reader_itself_refuses_an_escaping_storage_path(tmp_path: Path) -> None:
    # The check also sits in the reader DCP uses, for loads that do not go through read_checked_metadata first.
    directory = _sharded(tmp_path)
    _point_storage_at(directory, "../outside.distcp")
    with pytest.raises(ValueError, match=r"names the storage file '\.\./outside\.distcp'"):
        safe.reader(str(directory), "load", None).read_metadata()


@pytest.mark.parametrize("tag", ["../elsewhere", "{absolute}", "elsewhere/checkpoint", "..", "."])
def test_a_deepspeed_latest_file_pointing_outside_is_refused(
    tmp_path: Path, tag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _deepspeed(tmp_path)
    # A complete tag folder lies where the crafted tag points: following it would load it.
    shutil.copytree(directory / "checkpoint", tmp_path / "elsewhere")
    name = tag.format(absolute=tmp_path / "elsewhere")
    (directory / "latest").write_text(name + "\n")
    pattern = rf"the checkpoint's 'latest' file names the tag {re.escape(repr(name))}, which is not a folder inside"

    with pytest.raises(ValueError, match=rf"^load\({re.escape(repr(str(directory)))}\): " + pattern):
        _fabric().load(directory)
    with pytest.raises(ValueError, match=pattern):
        _fabric().load(directory, weights_only=False)
    assert cli_main(["consolidate", str(directory), str(tmp_path / "out.pt")]) == 2
    assert re.search(r"consolidate\(.*" + pattern, capsys.readouterr().err)


def test_deepspeed_is_handed_the_vetted_tag(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # For ZeRO stages 1-3, DeepSpeed's own consolidation would read `latest` again unless it is given the tag.
    from fabric.strategies.deepspeed import checkpoint as ckpt

    directory = _deepspeed(tmp_path)
    seen: dict[str, Any] = {}

    def fake_fp32(checkpoint_dir: str, tag: str | None = None, **kwargs: Any) -> dict[str, Any]:
        seen["tag"] = tag
        return {}

    import deepspeed.utils.zero_to_fp32 as zero_to_fp32

    monkeypatch.setattr(zero_to_fp32, "get_fp32_state_dict_from_zero_checkpoint", fake_fp32)
    monkeypatch.setattr(ckpt, "saved_stage", lambda states: 2)
    monkeypatch.setattr(ckpt, "check_rank_files", lambda *args: None)
    ckpt.full_weights(directory)
    assert seen["tag"] == "checkpoint"


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_an_intact_protocol_4_file_is_not_called_corrupt(tmp_path: Path, legacy: bool) -> None:
    path = tmp_path / "p4.ckpt"
    saved = {"w": torch.arange(3.0), "step": 2}
    torch.save(saved, path, pickle_protocol=4, _use_new_zipfile_serialization=not legacy)
    fabric = _fabric()
    for load in (fabric.load, lambda p: fabric.load(p, weights_only=True)):
        with pytest.raises(UnsafeCheckpointError, match=r"the checkpoint is intact") as info:
            load(path)
        message = str(info.value)
        assert f"load({str(path)!r})" in message and "pickle protocol 4" in message
        assert "load(..., weights_only=False)" in message and "trust" in message
        assert "not a readable checkpoint" not in message and "corrupt" not in message
    loaded = fabric.load(path, weights_only=False)
    assert torch.equal(loaded["w"], saved["w"]) and loaded["step"] == 2

    # A damaged protocol 4 file is still called unreadable.
    damaged = tmp_path / "damaged.ckpt"
    damaged.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])
    with pytest.raises(RuntimeError, match="this is not a readable checkpoint"):
        fabric.load(damaged)


def test_a_protocol_4_deepspeed_directory_is_not_called_corrupt(tmp_path: Path) -> None:
    directory = _deepspeed(tmp_path, pickle_protocol=4)
    with pytest.raises(UnsafeCheckpointError, match=r"^load\(.*the checkpoint is intact.*weights_only=False"):
        _fabric().load(directory)
    weights = _fabric().load(directory, weights_only=False)["model"]
    assert set(weights) == set(_model().state_dict())


def test_a_refused_deepspeed_directory_names_the_call_that_was_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory = _deepspeed(tmp_path)
    states = directory / "checkpoint" / "mp_rank_00_model_states.pt"
    states.write_bytes(_hostile.torch_file(_hostile.PROTO2 + _hostile.global_op("os", "system") + _hostile.STOP))
    expected = f"load({str(directory)!r}): refused to load the checkpoint for safety"
    for call in (lambda: _fabric().load(directory), lambda: _fabric().load_raw(directory, _model())):
        with pytest.raises(UnsafeCheckpointError) as info:
            call()
        assert str(info.value).startswith(expected) and "consolidate(" not in str(info.value)
    assert cli_main(["consolidate", str(directory), str(tmp_path / "out.pt")]) == 2
    assert f"consolidate({str(directory)!r}): refused" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["yes", "False", 0, 1, [True]])
def test_weights_only_must_be_a_bool(tmp_path: Path, value: Any) -> None:
    fabric = _fabric()
    file = tmp_path / "ok.ckpt"
    fabric.save(file, {"w": torch.ones(2)})
    directories = {"sharded": _sharded(tmp_path), "deepspeed": _deepspeed(tmp_path)}
    pattern = rf"weights_only={re.escape(repr(value))}\): weights_only must be True, False or None, not"
    for path in (file, *directories.values()):
        with pytest.raises(TypeError, match=r"^load\(\.\.\., " + pattern):
            fabric.load(path, weights_only=value)
        with pytest.raises(TypeError, match=r"^load_raw\(\.\.\., " + pattern):
            fabric.load_raw(path, _model(), weights_only=value)
    from fabric.checkpoint.sharded import consolidate
    from fabric.strategies.deepspeed.checkpoint import consolidate_deepspeed

    with pytest.raises(TypeError, match=pattern):
        consolidate(directories["sharded"], weights_only=value)
    with pytest.raises(TypeError, match=pattern):
        consolidate_deepspeed(directories["deepspeed"], weights_only=value)
    for value_ok in (None, True, False):  # the accepted values still load
        assert torch.equal(fabric.load(file, weights_only=value_ok)["w"], torch.ones(2))


def test_no_exception_type_chosen_by_the_metadata_escapes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Nothing on the allow-list can raise SystemExit; allow sys.exit here to show that if something ever did,
    # the process would get the refusal instead of ending (with exit code 0, and no message).
    directory = _sharded(tmp_path)
    allowed = safe._allowed
    monkeypatch.setattr(safe, "_allowed", lambda m, n: sys.exit if (m, n) == ("sys", "exit") else allowed(m, n))
    exit_call = _hostile.global_op("sys", "exit") + b"K\x00" + b"\x85" + b"R"
    (directory / ".metadata").write_bytes(_hostile.PROTO2 + exit_call + _hostile.STOP)
    with pytest.raises(UnsafeCheckpointError, match=r"refused to load the checkpoint for safety"):
        _fabric().load(directory)


def test_a_hostile_metadata_at_a_url_is_refused_without_importing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fsspec

    marker = tmp_path / "marker"
    modules = tmp_path / "modules"
    modules.mkdir()
    _hostile.write_side_effect_modules(modules, marker)
    monkeypatch.syspath_prepend(str(modules))
    directory = _sharded(tmp_path)
    (directory / ".metadata").write_bytes(
        _hostile.PROTO4 + _hostile.stack_global(_hostile.WRITER_MODULE, "run") + _hostile.STOP
    )
    fs = fsspec.filesystem("memory")
    for file in directory.iterdir():
        fs.pipe_file(f"/hostile-url/{file.name}", file.read_bytes())
    url = "memory://hostile-url"
    try:
        with pytest.raises(UnsafeCheckpointError, match=rf"load\('{url}'\): refused .*{_hostile.WRITER_MODULE}\.run"):
            _fabric().load(url)
    finally:
        fs.rm("/hostile-url", recursive=True)
    assert _hostile.WRITER_MODULE not in sys.modules and not marker.exists()


@pytest.mark.parametrize(("given", "passed"), [(None, True), (True, True), (False, False)])
def test_cloud_io_load_from_http_keeps_the_safe_default(
    monkeypatch: pytest.MonkeyPatch, given: bool | None, passed: bool
) -> None:
    # torch.hub.load_state_dict_from_url unpickles anything unless weights_only=True is passed to it.
    from fabric.utilities.cloud_io import _load

    seen: dict[str, Any] = {}
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", lambda url, **kwargs: seen.update(kwargs))
    _load("https://example.invalid/model.pt", weights_only=given)
    assert seen["weights_only"] is passed


def test_deepspeed_engine_loads_the_folder_that_was_checked(tmp_path: Path) -> None:
    # `latest` names a clean folder; a hostile one sits under fabric's default tag name. The engine must be told
    # to read the folder the safety check read, or it would unpickle the unchecked one.
    from types import SimpleNamespace

    from fabric.strategies.deepspeed import state as ds_state

    directory = _deepspeed(tmp_path)
    (directory / "checkpoint").rename(directory / "clean")
    (directory / "latest").write_text("clean")
    (directory / "checkpoint").mkdir()
    hostile = _hostile.PROTO2 + _hostile.global_op("os", "system") + _hostile.STOP
    (directory / "checkpoint" / "mp_rank_00_model_states.pt").write_bytes(_hostile.torch_file(hostile))
    model = _model()
    seen: dict[str, Any] = {}

    def load_checkpoint(load_dir: str, tag: str, **kwargs: Any) -> tuple[str, dict[str, Any]]:
        seen["tag"] = tag
        return load_dir, {}

    engine = SimpleNamespace(module=model, load_checkpoint=load_checkpoint)
    ds_state.load(engine, directory, {"model": model}, True, 1, True)  # type: ignore[arg-type]
    assert seen["tag"] == "clean"


def test_an_intact_pickle_with_an_opcode_the_safe_loader_lacks_names_the_opcode(tmp_path: Path) -> None:
    # INST of a class torch allows: nothing unsafe, only an opcode the weights-only unpickler does not implement.
    path = tmp_path / "inst.ckpt"
    path.write_bytes(_hostile.torch_file(b"(icollections\nOrderedDict\n."))
    with pytest.raises(UnsafeCheckpointError, match=r"intact, .* it uses the pickle opcode INST, which") as info:
        _fabric().load(path)
    assert "weights_only=False" in str(info.value)
    assert _fabric().load(path, weights_only=False) == {}
