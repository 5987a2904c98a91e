"""FSDPPrecision: what FSDP strategies run with for every precision name; its policy and errors."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from fabric import Fabric, MixedPrecision, Precision
from fabric.precision import FSDPPrecision

pytestmark = pytest.mark.usefixtures("no_cluster_env")


@pytest.mark.parametrize(
    ("precision", "param_dtype", "module_dtype"),
    [
        ("32-true", None, torch.float32),
        ("64-true", None, torch.float64),
        ("bf16-true", None, torch.bfloat16),
        ("16-true", None, torch.float16),
        ("bf16-mixed", torch.bfloat16, torch.float32),
    ],
)
def test_a_precision_name_with_fsdp_becomes_an_fsdp_precision(
    precision: str, param_dtype: torch.dtype | None, module_dtype: torch.dtype
) -> None:
    plugin = Fabric(accelerator="cpu", devices=2, strategy="fsdp", precision=precision).strategy.precision
    assert isinstance(plugin, FSDPPrecision) and plugin.precision == precision
    # the policy fully_shard gets: 16-bit compute, float32 reduction for `*-mixed` only
    expected = (
        None if param_dtype is None else MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    )
    assert (
        Fabric(accelerator="cpu", devices=2, strategy="fsdp", precision=precision).strategy.mixed_precision_policy
        == expected
    )  # type: ignore[attr-defined]
    assert plugin.convert_module(nn.Linear(2, 2)).weight.dtype == module_dtype
    with plugin.module_init_context():
        assert nn.Linear(2, 2).weight.dtype == module_dtype


def test_mixed_computes_in_16_bits_and_returns_float32() -> None:
    plugin = FSDPPrecision("bf16-mixed", device="cpu")
    assert plugin.scaler is None and not plugin.requires_fabric_backward
    x = plugin.convert_input(torch.ones(2))
    assert x.dtype == torch.bfloat16
    with plugin.forward_context():
        y = nn.functional.linear(torch.ones(1, 2), torch.ones(2, 2))
    assert y.dtype == torch.bfloat16
    assert plugin.convert_output(y).dtype == torch.float32


def test_a_plugin_passed_to_fsdp_is_converted_and_custom_ones_are_kept() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="fsdp", plugins=[MixedPrecision("bf16-mixed", "cpu")])
    assert isinstance(fabric.strategy.precision, FSDPPrecision)
    assert fabric.strategy.precision.precision == "bf16-mixed"

    class Mine(Precision):
        precision = "32-true"

    own = Mine()
    assert Fabric(accelerator="cpu", devices=2, strategy="fsdp", plugins=[own]).strategy.precision is own


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"precision": "transformer-engine"}, "FSDPPrecision(precision='transformer-engine'): sharded parameters"),
        ({"precision": "bf16-mixed", "scaler": torch.amp.GradScaler("cpu")}, "only float16 mixed precision scales"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, message: str) -> None:
    import re

    with pytest.raises(ValueError, match=re.escape(message)):
        FSDPPrecision(**kwargs)


@pytest.mark.parametrize(
    ("precision", "dtype"),
    [
        ("16-true", torch.float16),
        ("16-mixed", torch.float16),
        ("bf16-true", torch.bfloat16),
        ("bf16-mixed", torch.bfloat16),
        ("32-true", torch.float32),
        ("64-true", None),  # Lightning raises here; there is no config to describe
    ],
)
def test_mixed_precision_config_has_lightnings_three_dtypes(precision: str, dtype: torch.dtype | None) -> None:
    config = FSDPPrecision(precision, device="cpu").mixed_precision_config  # type: ignore[arg-type]
    if dtype is None:
        assert config is None
        return
    assert (config.param_dtype, config.reduce_dtype, config.buffer_dtype) == (dtype, dtype, dtype)  # type: ignore[attr-defined]
    assert isinstance(config, MixedPrecisionPolicy)  # an FSDP2 policy underneath
