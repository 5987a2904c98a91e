"""Loading is safe by default: nothing in a checkpoint runs code unless the user passes weights_only=False.

A malicious checkpoint's pickle writes a marker file when unpickled; it goes through every load path (fabric.load
with and without a state, load_raw, fabric consolidate on a sharded and on a DeepSpeed directory).
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.cli import main as cli_main

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")

REFUSED = r"refused to load the checkpoint for safety.*weights_only=False"


class _Payload:
    """Unpickling this runs `code` (what an attacker's checkpoint would do); it then evaluates to `result`."""

    def __init__(self, code: str) -> None:
        self.code = code

    def __reduce__(self) -> tuple[Any, ...]:
        return (eval, (self.code,))


def _marker_code(marker: Path, result: str = "'pwned'") -> str:
    return f"(open({str(marker)!r}, 'w').write('x'), {result})[1]"


def _fabric() -> Fabric:
    return Fabric(accelerator="cpu", devices=1)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3), nn.Linear(3, 2))


def test_everything_fabric_save_writes_loads_with_the_safe_default(tmp_path: Path) -> None:
    fabric = _fabric()
    model = _model()
    optimizers = {
        "adam": torch.optim.Adam(model.parameters(), lr=0.1),
        "adamw": torch.optim.AdamW(model.parameters(), lr=0.1, amsgrad=True),
        "sgd": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True),
    }
    model(torch.randn(5, 4)).sum().backward()
    for optimizer in optimizers.values():
        optimizer.step()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizers["sgd"], step_size=2)
    plain = {
        "step": 7,
        "loss": 0.25,
        "name": "run-1",
        "ids": [1, 2, 3],
        "shape": (2, 3),
        "nested": {"a": {"b": [None, True, False]}},
        "nothing": None,
        "flag": True,
        "ema": torch.arange(4.0),
        "python_rng": random.getstate(),
        "torch_rng": torch.get_rng_state(),
        "dtype": torch.bfloat16,
        "size": torch.Size([3, 4]),
    }
    path = tmp_path / "all.ckpt"
    fabric.save(path, {"model": model, **optimizers, "scheduler": scheduler, **plain})

    fresh = _model()
    fresh_optimizers = {
        "adam": torch.optim.Adam(fresh.parameters(), lr=0.1),
        "adamw": torch.optim.AdamW(fresh.parameters(), lr=0.1, amsgrad=True),
        "sgd": torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9, nesterov=True),
    }
    fresh_scheduler = torch.optim.lr_scheduler.StepLR(fresh_optimizers["sgd"], step_size=2)
    state: dict[str, Any] = {"model": fresh, **fresh_optimizers, "scheduler": fresh_scheduler}
    remainder = fabric.load(path, state)

    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    for key, optimizer in optimizers.items():
        saved, loaded = optimizer.state_dict(), fresh_optimizers[key].state_dict()
        assert saved["param_groups"] == loaded["param_groups"]
        for index, values in saved["state"].items():
            for field, value in values.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(loaded["state"][index][field])), field
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    assert remainder.keys() == plain.keys()
    for key, value in plain.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(remainder[key], value), key
        else:
            assert remainder[key] == value, key
    # The same file also loads whole, and as a raw module state dict.
    assert set(fabric.load(path)) == set(state) | set(plain)
    raw = tmp_path / "raw.pt"
    torch.save(model.state_dict(), raw)
    other = _model()
    fabric.load_raw(raw, other)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), other.state_dict().values(), strict=True))


@pytest.fixture
def evil_file(tmp_path: Path) -> tuple[Path, Path]:
    marker = tmp_path / "marker"
    path = tmp_path / "evil.ckpt"
    weights = _model().state_dict()
    torch.save({"model": weights, "note": _Payload(_marker_code(marker))}, path)
    return path, marker


@pytest.mark.parametrize("with_state", [False, True])
def test_fabric_load_refuses_a_code_running_checkpoint(evil_file: tuple[Path, Path], with_state: bool) -> None:
    path, marker = evil_file
    fabric = _fabric()
    state = {"model": _model()} if with_state else None
    with pytest.raises(pickle.UnpicklingError, match=REFUSED) as info:
        fabric.load(path, state)
    assert str(path) in str(info.value) and "builtins.eval" in str(info.value)
    assert not marker.exists()
    with pytest.raises(pickle.UnpicklingError, match=REFUSED):
        fabric.load(path, state, weights_only=True)
    assert not marker.exists()

    remainder = fabric.load(path, state, weights_only=False)  # the user trusts this file
    assert marker.exists()
    assert remainder["note"] == "pwned"


def test_load_raw_refuses_a_code_running_state_dict(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    model = _model()
    weights = dict(model.state_dict())
    path = tmp_path / "raw.pt"
    torch.save(_Payload(_marker_code(marker, "__import__('collections').OrderedDict()")), path)
    fabric = _fabric()
    with pytest.raises(pickle.UnpicklingError, match=REFUSED):
        fabric.load_raw(path, model)
    assert not marker.exists()
    # Trusted: the payload runs and yields an empty state dict, which strict=False accepts.
    fabric.load_raw(path, model, strict=False, weights_only=False)
    assert marker.exists()
    assert all(torch.equal(a, b) for a, b in zip(weights.values(), model.state_dict().values(), strict=True))


def test_a_corrupt_or_foreign_file_names_the_path(tmp_path: Path) -> None:
    fabric = _fabric()
    good = tmp_path / "good.ckpt"
    fabric.save(good, {"w": torch.ones(1000)})
    cases = {
        "truncated.ckpt": good.read_bytes()[:500],
        "garbage.ckpt": bytes(range(256)) * 4,
        "text.ckpt": b"step: 3\n" * 20,
        "empty.ckpt": b"",
    }
    for name, data in cases.items():
        path = tmp_path / name
        path.write_bytes(data)
        for weights_only in (None, False):
            with pytest.raises(RuntimeError, match=r"this is not a readable checkpoint") as info:
                fabric.load(path, weights_only=weights_only)
            assert str(path) in str(info.value), name


def _dcp_directory(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    import torch.distributed.checkpoint as dcp

    weights = {k: v.clone() for k, v in _model().state_dict().items()}
    directory = tmp_path / "sharded"
    dcp.save({"model": weights, "step": 3}, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    return directory, weights


def test_consolidate_refuses_a_sharded_checkpoint_with_malicious_metadata(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    directory, weights = _dcp_directory(tmp_path)
    marker = tmp_path / "marker"
    real = tmp_path / "real.metadata"
    (directory / ".metadata").rename(real)
    # The payload runs, then hands back the real metadata, so a trusting load still succeeds.
    code = _marker_code(marker, f"__import__('pickle').load(open({str(real)!r}, 'rb'))")
    (directory / ".metadata").write_bytes(pickle.dumps(_Payload(code)))
    output = tmp_path / "out.pt"

    assert cli_main(["consolidate", str(directory), str(output)]) == 2
    err = capsys.readouterr().err
    assert "refused to load the checkpoint for safety" in err and "builtins.eval" in err
    assert not marker.exists() and not output.exists()
    with pytest.raises(pickle.UnpicklingError, match=REFUSED):
        _fabric().load(directory)
    assert not marker.exists()

    assert cli_main(["consolidate", str(directory), str(output), "--no-weights-only"]) == 0
    assert marker.exists()
    consolidated = torch.load(output)
    assert consolidated["step"] == 3
    assert all(torch.equal(consolidated["model"][k], v) for k, v in weights.items())


def test_a_sharded_checkpoint_with_a_malicious_value_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch.distributed.checkpoint as dcp

    marker = tmp_path / "marker"
    directory = tmp_path / "sharded"
    state = {"model": _model().state_dict(), "note": _Payload(_marker_code(marker))}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    output = tmp_path / "out.pt"
    assert cli_main(["consolidate", str(directory), str(output)]) == 2
    assert "refused to load the checkpoint for safety" in capsys.readouterr().err
    with pytest.raises(pickle.UnpicklingError, match=REFUSED):
        _fabric().load(directory, {"model": _model()})
    assert not marker.exists()
    assert _fabric().load(directory, weights_only=False)["note"] == "pwned"
    assert marker.exists()


def test_a_clean_sharded_checkpoint_consolidates_with_the_safe_default(tmp_path: Path) -> None:
    directory, weights = _dcp_directory(tmp_path)
    output = tmp_path / "out.pt"
    assert cli_main(["consolidate", str(directory), str(output)]) == 0
    assert all(torch.equal(torch.load(output)["model"][k], v) for k, v in weights.items())


def _deepspeed_directory(tmp_path: Path, extra: dict[str, Any]) -> tuple[Path, dict[str, torch.Tensor]]:
    """The layout DeepSpeed writes for ZeRO stage 0 (full weights in the model-states file)."""
    weights = {k: v.clone() for k, v in _model().state_dict().items()}
    directory = tmp_path / "ds"
    (directory / "checkpoint").mkdir(parents=True)
    (directory / "latest").write_text("checkpoint")
    states = {
        "module": weights,
        "ds_config": {"zero_optimization": {"stage": 0}},
        "dp_world_size": 1,
        "ds_version": "0.0",
        "_fabric_module_key": "model",
        **extra,
    }
    torch.save(states, directory / "checkpoint" / "mp_rank_00_model_states.pt")
    return directory, weights


def test_consolidate_refuses_a_malicious_deepspeed_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "marker"
    directory, weights = _deepspeed_directory(tmp_path, {"note": _Payload(_marker_code(marker))})
    output = tmp_path / "out.pt"
    assert cli_main(["consolidate", str(directory), str(output)]) == 2
    err = capsys.readouterr().err
    assert "refused to load the checkpoint for safety" in err and "builtins.eval" in err
    with pytest.raises(pickle.UnpicklingError, match=REFUSED):
        _fabric().load(directory)
    assert not marker.exists() and not output.exists()

    assert cli_main(["consolidate", str(directory), str(output), "--no-weights-only"]) == 0
    assert marker.exists()
    consolidated = torch.load(output, weights_only=False)
    assert consolidated["note"] == "pwned"
    assert all(
        torch.equal(consolidated["model"][k], v.float() if v.is_floating_point() else v) for k, v in weights.items()
    )


def test_a_clean_deepspeed_checkpoint_consolidates_with_the_safe_default(tmp_path: Path) -> None:
    directory, weights = _deepspeed_directory(tmp_path, {"step": 4})
    output = tmp_path / "out.pt"
    assert cli_main(["consolidate", str(directory), str(output)]) == 0
    consolidated = torch.load(output)
    assert consolidated["step"] == 4
    assert all(torch.equal(consolidated["model"][k], v.float()) for k, v in weights.items() if v.is_floating_point())
