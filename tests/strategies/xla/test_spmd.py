"""xla_spmd for real: torch_xla on four virtual CPU devices (PJRT_DEVICE=CPU, CPU_NUM_DEVICES=4).

SPMD mode and the device count are fixed once torch_xla starts, so each scenario runs in a fresh process
(scripts/spmd_scenarios.py). Skipped where torch_xla is not installed (the torch 2.9 + torch-xla environment runs them).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.xla,
    pytest.mark.skipif(
        importlib.util.find_spec("torch_xla") is None,
        reason="needs torch_xla (pip install 'torchfabric[xla]'); the torch 2.9 + torch-xla environment runs these",
    ),
]

_SCRIPTS = Path(__file__).parent / "scripts"
_ROOT = Path(__file__).parents[3]
# Eager CPU and XLA's CPU backend run the same float32 math in a different order (XLA fuses and splits matmuls over
# the devices): after 3 AdamW steps the weights agree to a few float32 ulps of values below 1, i.e. ~1e-7.
_FLOAT32_TOL = 1e-5
_SHARDED_4 = "{devices=[4,1]0,1,2,3}"


def _run(script: str, *args: str, xla: bool = True) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PJRT_", "XLA_", "CPU_NUM_DEVICES"))}
    env["PYTHONPATH"] = os.pathsep.join([str(_ROOT), env.get("PYTHONPATH", "")])
    if xla:
        env.update(PJRT_DEVICE="CPU", CPU_NUM_DEVICES="4")
    done = subprocess.run(
        [sys.executable, str(_SCRIPTS / script), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]


_TRAINING = "fsdp,data_parallel,hybrid,tensor_parallel,clipped,two_step_setup,plan_errors,bf16-true,bf16-mixed"


@pytest.fixture(scope="module")
def training(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every training scenario, in one process (each with its own Fabric and mesh)."""
    outdir = tmp_path_factory.mktemp("spmd_training")
    _run("spmd_scenarios.py", _TRAINING, str(outdir))
    return json.loads((outdir / "result.json").read_text())


def test_fsdp_training_equals_eager_cpu_and_shards_parameters_and_batches(training: dict[str, Any]) -> None:
    result = training["fsdp"]
    assert result["max_diff"] < _FLOAT32_TOL
    assert result["wrapper"] == "SpmdFullyShardedDataParallel"
    # FSDPv2 splits each parameter along its largest dimension over the 4 devices of the 'fsdp' axis.
    assert result["param_specs"] == {
        "0.weight": _SHARDED_4,
        "0.bias": "{devices=[4]0,1,2,3}",
        "2.weight": "{devices=[1,4]0,1,2,3}",
        "2.bias": "{devices=[4]0,1,2,3}",
    }
    assert result["batch_specs"] == [[_SHARDED_4, "{devices=[4]0,1,2,3}"]] * 3  # inputs and labels, every batch
    # One process whose tensors are whole (logical): collectives are identities.
    assert (result["world_size"], result["global_rank"], result["device"]) == (1, 0, "xla:0")
    assert result["all_reduce"] == [1.0, 1.0]
    assert result["all_gather_shape"] == [2]


def test_data_parallel_mesh_replicates_parameters_and_splits_batches(training: dict[str, Any]) -> None:
    result = training["data_parallel"]
    assert result["max_diff"] < _FLOAT32_TOL
    assert result["wrapper"] == "Sequential"
    assert set(result["param_specs"].values()) == {"{replicated}"}
    assert result["batch_specs"][0] == [_SHARDED_4, "{devices=[4]0,1,2,3}"]


def test_hybrid_mesh_shards_parameters_over_fsdp_and_batches_over_data_and_fsdp(training: dict[str, Any]) -> None:
    result = training["hybrid"]  # mesh (2, 2, 1): data x fsdp x model
    assert result["max_diff"] < _FLOAT32_TOL
    # Parameters: 2 shards (fsdp), each copied on the 2 data replicas. Batches: 4 slices (data and fsdp together).
    assert result["param_specs"]["0.weight"] == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"
    assert result["batch_specs"][0][0] == _SHARDED_4


def test_tensor_parallel_plan_shards_the_named_weights_along_model(training: dict[str, Any]) -> None:
    result = training["tensor_parallel"]  # mesh (2, 2): fsdp x model
    assert result["max_diff"] < _FLOAT32_TOL
    specs = result["param_specs"]
    # Rows of the first weight and columns of the second over the 2 'model' devices (device order 0,2,1,3:
    # the 'model' axis is the mesh's second), copied over 'fsdp'; the biases are FSDPv2's, over 'fsdp'.
    assert specs["0.weight"] == "{devices=[2,1,2]0,2,1,3 last_tile_dim_replicate}"
    assert specs["2.weight"] == "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"
    assert specs["0.bias"] == "{devices=[2,2]0,1,2,3 last_tile_dim_replicate}"
    # Batches split over 'fsdp' only, copied over 'model'.
    assert result["batch_specs"][0][0] == "{devices=[2,1,2]0,1,2,3 last_tile_dim_replicate}"


def test_sharded_checkpoint_round_trips_and_loads_on_cpu_without_torch_xla(tmp_path: Path) -> None:
    _run("spmd_scenarios.py", "checkpoint,full_checkpoint,foreign_checkpoint", str(tmp_path))
    results = json.loads((tmp_path / "result.json").read_text())
    result = results["checkpoint"]  # TP-sharded and FSDPv2-sharded tensors, Adam state, a plain value
    assert result["files"] == [".metadata", "__0_0.distcp"]
    assert result["step"] == 3
    assert result["reload_diff"] == 0.0 and result["exp_avg_diff"] == 0.0
    assert result["reload_specs"]["2.weight"] == "{devices=[1,2,2]0,2,1,3 last_tile_dim_replicate}"
    _run("spmd_cpu_load.py", str(tmp_path), xla=False)
    cpu = json.loads((tmp_path / "cpu_result.json").read_text())
    assert cpu == {
        "torch_xla_imported": False,
        "step": 3,
        "model_diff": 0.0,
        "exp_avg_diff": 0.0,
        "consolidated_diff": 0.0,
    }
    # state_dict_type='full': one file of whole CPU tensors, which loads back into the sharded parameters.
    result = results["full_checkpoint"]
    assert result["is_file"] and result["devices"] == ["cpu"]
    assert result["reload_diff"] == 0.0
    assert result["reload_specs"]["0.weight"] == _SHARDED_4
    # A DCP directory plain torch wrote on the CPU (any sharded run's format) loads into the sharded weights.
    foreign = results["foreign_checkpoint"]
    assert foreign["epoch"] == 7 and foreign["diff"] == 0.0 and foreign["raw_diff"] == 0.0
    assert foreign["specs"]["0.weight"] == _SHARDED_4


def test_optimizer_created_before_setup_module_follows_the_parameters(training: dict[str, Any]) -> None:
    # setup_module moves the model (new parameter objects on XLA); setup_optimizers re-points the optimizer.
    assert training["two_step_setup"]["max_diff"] < _FLOAT32_TOL


def test_gradient_clipping_uses_the_norm_of_the_whole_model(training: dict[str, Any]) -> None:
    assert training["clipped"]["max_diff"] < _FLOAT32_TOL


def test_bf16_true_trains_in_bfloat16(training: dict[str, Any]) -> None:
    result = training["bf16-true"]
    assert result["dtype"] == "torch.bfloat16" and result["compute_dtypes"] == ["torch.bfloat16"]
    # Against eager CPU in bfloat16: the two backends round differently; 0.03 is ~4 bfloat16 ulps at |w| < 1.
    assert result["max_diff"] < 0.03


def test_bf16_mixed_keeps_float32_weights_and_computes_in_bfloat16(training: dict[str, Any]) -> None:
    result = training["bf16-mixed"]
    assert result["dtype"] == "torch.float32" and result["compute_dtypes"] == ["torch.bfloat16"]
    # Against eager float32: bfloat16 matmuls change the weights by a few bfloat16 ulps of the updates.
    assert result["max_diff"] < 0.01


def test_plan_pattern_matching_nothing_or_not_fitting_is_explained(training: dict[str, Any]) -> None:
    errors = training["plan_errors"]
    assert "'encoder.*'" in errors["no_match"] and "matches no parameter of the model" in errors["no_match"]
    assert "0.weight, 0.bias, 2.weight, 2.bias" in errors["no_match"]
    assert "'0.bias' has 1 dimensions" in errors["rank"] and "the spec has 2 entries" in errors["rank"]
