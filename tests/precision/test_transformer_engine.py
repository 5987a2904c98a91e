"""TransformerEnginePrecision: float8 needs Transformer Engine on a CUDA GPU; elsewhere a clear error.

The layer conversion is checked against a stand-in `transformer_engine` module (its Linear and LayerNorm are
torch layers under Transformer Engine's module name), with CUDA faked through torch.cuda.is_available; the
real float8 run needs a GPU with transformer_engine and is marked `cuda`.
"""

from __future__ import annotations

import enum
import importlib.machinery
import importlib.util
import sys
import types
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from fabric import Fabric
from fabric.precision import TransformerEnginePrecision

HAS_TE = importlib.util.find_spec("transformer_engine") is not None


@pytest.mark.skipif(HAS_TE and torch.cuda.is_available(), reason="this machine has Transformer Engine and CUDA")
def test_a_machine_without_transformer_engine_or_cuda_gets_a_clear_error() -> None:
    lacks = [] if HAS_TE else ["the transformer_engine package (pip install transformer-engine[pytorch])"]
    lacks += [] if torch.cuda.is_available() else ["a CUDA GPU"]
    with pytest.raises(RuntimeError) as err:
        TransformerEnginePrecision(weights_dtype=torch.bfloat16)
    assert str(err.value) == (
        "TransformerEnginePrecision(): float8 training needs NVIDIA Transformer Engine on a CUDA GPU, and this "
        f"machine lacks {' and '.join(lacks)}. Use precision='bf16-mixed' here."
    )


def test_with_cuda_but_without_the_package_the_package_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    with pytest.raises(RuntimeError, match=r"this machine lacks the transformer_engine package \(pip install"):
        TransformerEnginePrecision(weights_dtype=torch.bfloat16)


@pytest.fixture
def stand_in_te(monkeypatch: pytest.MonkeyPatch) -> types.SimpleNamespace:
    """A `transformer_engine` with the API the plugin uses, and CUDA reported available."""

    class Format(enum.Enum):
        E4M3 = 1
        HYBRID = 2

    @dataclass
    class DelayedScaling:
        fp8_format: Format = Format.HYBRID
        amax_history_len: int = 1024

    class Linear(nn.Linear):
        pass

    class LayerNorm(nn.LayerNorm):
        pass

    Linear.__module__ = LayerNorm.__module__ = "transformer_engine.pytorch"
    recorded: list[Any] = []
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.Linear, pytorch.LayerNorm = Linear, LayerNorm  # type: ignore[attr-defined]
    pytorch.fp8_autocast = lambda **kwargs: recorded.append(kwargs) or nullcontext()  # type: ignore[attr-defined]
    recipe = types.ModuleType("transformer_engine.common.recipe")
    recipe.DelayedScaling, recipe.Format = DelayedScaling, Format  # type: ignore[attr-defined]
    for name, module in {
        "transformer_engine": types.ModuleType("transformer_engine"),
        "transformer_engine.pytorch": pytorch,
        "transformer_engine.common": types.ModuleType("transformer_engine.common"),
        "transformer_engine.common.recipe": recipe,
    }.items():
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    return types.SimpleNamespace(Linear=Linear, LayerNorm=LayerNorm, Format=Format, recorded=recorded)


def test_linear_and_layernorm_layers_are_replaced_and_cast(stand_in_te: types.SimpleNamespace) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.Sequential(nn.Linear(32, 4)))
    original = {k: v.clone() for k, v in model.state_dict().items()}
    plugin = TransformerEnginePrecision(weights_dtype=torch.bfloat16, recipe={"fp8_format": "E4M3"})
    assert plugin.recipe.fp8_format is stand_in_te.Format.E4M3
    assert plugin.precision == "transformer-engine"
    with pytest.warns(UserWarning, match=r"layer '2.0' \(32 -> 4\) is not replaced: float8 needs in_features"):
        converted = plugin.convert_module(model)
    assert type(converted[0]) is stand_in_te.Linear and type(converted[1]) is stand_in_te.LayerNorm
    assert type(converted[2][0]) is nn.Linear
    for key, value in converted.state_dict().items():
        assert value.dtype == torch.bfloat16
        assert torch.equal(value, original[key].to(torch.bfloat16))


def test_a_model_with_its_own_te_layers_or_replace_layers_false_is_only_cast(
    stand_in_te: types.SimpleNamespace,
) -> None:
    plugin = TransformerEnginePrecision(weights_dtype=torch.float16, replace_layers=False)
    assert plugin.precision == "transformer-engine-float16"
    model = plugin.convert_module(nn.Sequential(nn.Linear(16, 32)))
    assert type(model[0]) is nn.Linear and model[0].weight.dtype == torch.float16
    mixed = nn.Sequential(stand_in_te.Linear(16, 32), nn.Linear(16, 32))
    assert type(TransformerEnginePrecision(weights_dtype=torch.bfloat16).convert_module(mixed)[1]) is nn.Linear


@pytest.mark.cuda
@pytest.mark.skipif(not (HAS_TE and torch.cuda.is_available()), reason="needs transformer_engine and a CUDA GPU")
def test_float8_training_step_on_a_gpu() -> None:
    fabric = Fabric(accelerator="cuda", devices=1, plugins=[TransformerEnginePrecision(weights_dtype=torch.bfloat16)])
    model = fabric.setup_module(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16)))
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    x = torch.randn(32, 32, device=fabric.device)
    losses = []
    for _ in range(3):
        loss = model(x).float().pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
