"""Lightning Fabric's private helpers that published projects import (litgpt, sheeprl, ...), at the same paths."""

from __future__ import annotations

import os
import subprocess
import sys
from argparse import Namespace
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import torch


@dataclass
class _Config:
    lr: float = 0.1


def test_logger_helpers_flatten_and_convert_hyperparameters() -> None:
    from fabric.utilities.logger import _convert_params, _flatten_dict

    assert _convert_params(None) == {} and _convert_params(Namespace(a=1)) == {"a": 1}
    assert _convert_params({"a": 1}) == {"a": 1}
    assert _flatten_dict({"a": {"b": "c"}, 5: {"x": 1}}) == {"a/b": "c", "5/x": 1}
    nested = {"dl": [{"a": 1}, {"b": 2}], "l": [1, 2], "n": Namespace(c=_Config()), "empty": []}
    # a list of dicts is indexed with "/" whatever the delimiter; an empty list vanishes (both as in Lightning)
    assert _flatten_dict(nested, delimiter=".") == {"dl/0.a": 1, "dl/1.b": 2, "l": [1, 2], "n.c.lr": 0.1}


def test_precision_utils_cast_only_floats_and_set_the_default_dtype() -> None:
    from fabric.plugins.precision.utils import _convert_fp_tensor, _DtypeContextManager

    assert _convert_fp_tensor(torch.ones(2), torch.float16).dtype == torch.float16
    assert _convert_fp_tensor(torch.ones(2, dtype=torch.int64), torch.float16).dtype == torch.int64
    with _DtypeContextManager(torch.float64):
        assert torch.get_default_dtype() == torch.float64
    assert torch.get_default_dtype() == torch.float32


def test_distributed_helpers_without_a_process_group() -> None:
    from fabric.utilities.distributed import (
        _all_gather_ddp_if_available,
        _distributed_is_initialized,
        _get_default_process_group_backend_for_device,
        _sync_ddp_if_available,
    )

    tensor = torch.ones(2)
    assert not _distributed_is_initialized()
    assert _sync_ddp_if_available(tensor) is tensor and _all_gather_ddp_if_available(tensor) is tensor
    assert _get_default_process_group_backend_for_device(torch.device("cuda", 0)) == "nccl"
    assert _get_default_process_group_backend_for_device(torch.device("cpu")) == "gloo"


def test_small_names(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch.optim.lr_scheduler import LRScheduler

    from fabric.plugins.collectives.collective import CollectibleGroup
    from fabric.plugins.collectives.torch_collective import default_pg_timeout
    from fabric.utilities.imports import _TORCH_GREATER_EQUAL_2_0, _TORCH_GREATER_EQUAL_2_1
    from fabric.utilities.rank_zero import _get_rank
    from fabric.utilities.types import _TORCH_LRSCHEDULER

    assert default_pg_timeout == timedelta(minutes=30)
    assert _TORCH_GREATER_EQUAL_2_0 and _TORCH_GREATER_EQUAL_2_1 and _TORCH_LRSCHEDULER is LRScheduler
    assert CollectibleGroup is not None
    torchrun = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for name, value in torchrun.items():
        monkeypatch.setenv(name, value)
    assert _get_rank() == 3


def test_connector_types_and_precision_names() -> None:
    from typing import get_args

    from fabric.connector import _PLUGIN_INPUT, _PRECISION_INPUT, _convert_precision_to_unified_args

    assert 16 in get_args(get_args(_PRECISION_INPUT)[0]) and len(get_args(_PLUGIN_INPUT)) == 3
    assert _convert_precision_to_unified_args(None) is None
    assert _convert_precision_to_unified_args("bf16-true") == "bf16-true"
    assert _convert_precision_to_unified_args(32) == "32-true" and _convert_precision_to_unified_args("64") == "64-true"
    with pytest.warns(UserWarning, match=r"precision=16 is a shorthand.*means '16-mixed'"):
        assert _convert_precision_to_unified_args(16) == "16-mixed"
    with pytest.warns(UserWarning, match="means 'bf16-mixed'"):
        assert _convert_precision_to_unified_args("bf16") == "bf16-mixed"
    with pytest.raises(ValueError, match=r"precision='fp8': this is no precision name. Use one of"):
        _convert_precision_to_unified_args("fp8")  # type: ignore[arg-type]


def test_external_callbacks_come_from_entry_point_factories(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric.utilities import registry

    class _EntryPoint:
        def __init__(self, name: str, made: object) -> None:
            self.name, self._made = name, made

        def load(self) -> object:
            return lambda: self._made

    groups = {"my.group": [_EntryPoint("one", "a"), _EntryPoint("many", ["b", "c"]), _EntryPoint("none", [])]}
    monkeypatch.setattr(registry, "entry_points", lambda group: groups.get(group, []))
    assert registry._load_external_callbacks("my.group") == ["a", "b", "c"]
    assert registry._load_external_callbacks("other.group") == []


def test_consolidate_checkpoint_module_writes_the_folder_as_one_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import warnings

    from fabric.checkpoint import sharded
    from fabric.utilities import consolidate_checkpoint

    model = torch.nn.Linear(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's note that it runs without a process group
        sharded.save_sharded(tmp_path / "ckpt", {"model": model, "step": 4}, None, 1, 0, lambda: None)
    command = [sys.executable, "-m", "fabric.utilities.consolidate_checkpoint", str(tmp_path / "ckpt")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    whole = torch.load(tmp_path / "ckpt.consolidated")
    assert whole["step"] == 4 and torch.equal(whole["model"]["weight"], model.weight)
    # The refusals call the same main() that `python -m` ran above, here in this process: each new process
    # would spend seconds importing torch to print one line. sys.exit(1) is the exit status 1 of the command.
    with pytest.raises(SystemExit) as again:
        consolidate_checkpoint.main([str(tmp_path / "ckpt")])
    assert again.value.code == 1 and "already exists, and consolidating would replace it" in capsys.readouterr().err
    with pytest.raises(SystemExit) as missing:
        consolidate_checkpoint.main([str(tmp_path / "nope")])
    assert missing.value.code == 1 and "does not exist. Pass the folder a sharded save wrote" in capsys.readouterr().err


def test_runif_reasons_name_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from fabric.utilities.testing import _runif_reasons

    assert _runif_reasons() == ([], {})
    assert (
        _runif_reasons(min_torch="2.0", max_torch="99.0", min_python="3.8", linux_only=sys.platform == "linux")[0] == []
    )
    reasons, markers = _runif_reasons(min_cuda_gpus=99, min_torch="99.1", min_python="9.0")
    assert reasons[0] == "GPUs>=99" and reasons[1].startswith("torch>=99.1, ") and reasons[2] == "python>=9.0"
    assert markers == {"min_cuda_gpus": True}
    monkeypatch.delenv("PL_RUN_STANDALONE_TESTS", raising=False)
    assert _runif_reasons(standalone=True) == (["Standalone execution"], {"standalone": True})
    monkeypatch.setenv("PL_RUN_STANDALONE_TESTS", "1")
    assert _runif_reasons(standalone=True) == ([], {"standalone": True})
    with pytest.raises(ValueError, match=r"version 'latest' is not of the form MAJOR.MINOR"):
        _runif_reasons(min_torch="latest")
