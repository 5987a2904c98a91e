"""A model created under fabric.init_module() trains with DeepSpeed ZeRO 1, 2 and 3 in every precision DeepSpeed
supports on the CPU, on two real processes; unsupported ones fail with fabric's message (scripts/ds_init_module.py).
"""

from __future__ import annotations

import itertools
from typing import Any

import _it_runner as runner
import pytest
import torch

pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install torchfabric[deepspeed])")

pytestmark = pytest.mark.multiprocess

# 16-bit runs against float32 DDP started from the same initial weights: the forward/backward in 16 bits moves each
# of the 4 AdamW updates (lr 0.05) by a small fraction; measured 1.6e-3 (bfloat16) and 6.4e-4 (float16) on weights of
# size ~0.5.
HALF_ATOL = 1e-2
DTYPES = {"32-true": "torch.float32", "bf16-mixed": "torch.bfloat16", "bf16-true": "torch.bfloat16"}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("ds_init_module")
    run = runner.run_script("ds_init_module.py", str(folder), timeout=420)
    assert run.returncode == 0, run.output
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


def _trained(result: dict[str, Any], name: str) -> dict[str, Any]:
    observed = result[name]
    if "error" in observed:
        pytest.fail(f"{name} raised:\n{observed['error']}")
    return observed


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert set(a) == set(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_init_module_model_trains_on_a_cpu_without_float16(
    results: list[dict[str, Any]], stage: int, precision: str
) -> None:
    for rank, result in enumerate(results):
        ddp = _trained(result, "ddp")
        observed = _trained(result, f"nofp16_stage{stage}_{precision}")
        assert observed["partitioned"] is (stage == 3), f"rank {rank}"  # zero.Init only for stage 3
        assert observed["dtypes"] == [DTYPES[precision]]
        losses = observed["losses"]
        assert losses[-1] < losses[0] - 0.05 and all(b < a for a, b in itertools.pairwise(losses)), losses
        if precision == "32-true":
            # The same math as DDP: ZeRO's reduce-scatter adds the same two numbers as DDP's all-reduce.
            assert losses == ddp["losses"], f"rank {rank}"
            assert _max_diff(observed["weights"], ddp["weights"]) == 0.0, f"rank {rank}"
        else:
            reference = observed["reference"]
            assert _max_diff(observed["weights"], reference["weights"]) <= HALF_ATOL, f"rank {rank}"
            assert losses == pytest.approx(reference["losses"], abs=HALF_ATOL)


def test_a_deepspeed_precision_plugin_trains_as_the_precision_name_does(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        by_plugin = _trained(result, "plugin_stage3_bf16-mixed")
        by_name = _trained(result, "nofp16_stage3_bf16-mixed")
        assert by_plugin["losses"] == by_name["losses"], f"rank {rank}"
        assert _max_diff(by_plugin["weights"], by_name["weights"]) == 0.0


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_float16_fails_with_fabrics_message_where_deepspeed_lacks_it(results: list[dict[str, Any]], stage: int) -> None:
    for result in results:
        message = result[f"nofp16_stage{stage}_16-true"].get("message")
        assert message == (
            "RuntimeError: Fabric(strategy='deepspeed', precision='16-true'): DeepSpeed's 'cpu' accelerator has no "
            "float16 support on this machine. Use precision='bf16-mixed' (or 'bf16-true', '32-true')."
        )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_float16_trains_where_the_cpu_supports_it(results: list[dict[str, Any]], stage: int) -> None:
    for rank, result in enumerate(results):
        observed = result[f"stage{stage}_16-true"]
        if not result["fp16_supported"]:
            assert "has no float16 support on this machine" in observed["message"]  # this CPU has no oneDNN fp16
            continue
        observed = _trained(result, f"stage{stage}_16-true")
        assert observed["dtypes"] == ["torch.float16"]
        assert observed["losses"][-1] < observed["losses"][0] - 0.05
        assert _max_diff(observed["weights"], observed["reference"]["weights"]) <= HALF_ATOL, f"rank {rank}"
