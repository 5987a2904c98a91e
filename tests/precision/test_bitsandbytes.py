"""BitsandbytesPrecision end to end on the CPU: bitsandbytes >= 0.45 has a CPU backend, and all six modes run there."""

from __future__ import annotations

import itertools
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from fabric import Fabric

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install bitsandbytes)")

from fabric.precision import BitsandbytesPrecision  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("no_cluster_env"),
    pytest.mark.filterwarnings("ignore::UserWarning"),  # bitsandbytes' notices about its optional CPU kernels
]

# mode -> (layer class, stored weight dtype, whether the weights themselves train)
MODES = {
    "nf4": (bnb.nn.Linear4bit, torch.uint8, False),
    "nf4-dq": (bnb.nn.Linear4bit, torch.uint8, False),
    "fp4": (bnb.nn.Linear4bit, torch.uint8, False),
    "fp4-dq": (bnb.nn.Linear4bit, torch.uint8, False),
    "int8": (bnb.nn.Linear8bitLt, torch.int8, False),
    "int8-training": (bnb.nn.Linear8bitLt, torch.float16, True),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU())
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_quantises_the_linear_layers_and_trains_on_the_cpu(mode: str) -> None:
    layer_class, weight_dtype, weights_train = MODES[mode]
    x, y = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)), torch.randn(8, 4)
    plain = Net()
    with torch.no_grad():
        expected = plain(x)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[BitsandbytesPrecision(mode)])
    model = fabric.setup_module(Net())
    # Created after setup: the quantised layers' parameters replaced the Linear ones.
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    inner = model.module
    assert isinstance(inner.body[0], layer_class) and isinstance(inner.head, layer_class)
    assert inner.head.weight.dtype == weight_dtype and inner.head.weight.requires_grad is weights_train
    assert inner.body[1].weight.dtype == torch.float16  # the other layers run in the compute dtype
    with torch.no_grad():
        output = model(x)
    assert output.dtype == torch.float32  # back in the default dtype for the loss
    assert (output - expected).abs().max() < 0.3  # 4-bit weights: a coarse but faithful copy
    frozen = inner.head.weight.detach().clone()
    losses = []
    for _ in range(5):
        loss = nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    assert torch.equal(inner.head.weight.detach(), frozen) is not weights_train


def test_int8_matches_the_float_model_closely() -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = Net()(x)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[BitsandbytesPrecision("int8")])
    with torch.no_grad():
        assert (fabric.setup_module(Net())(x) - expected).abs().max() < 0.02


def test_ignore_modules_keeps_those_layers_in_the_compute_dtype() -> None:
    plugin = BitsandbytesPrecision("nf4", dtype=torch.bfloat16, ignore_modules={"head"})
    model = Fabric(accelerator="cpu", devices=1, plugins=[plugin]).setup_module(Net()).module
    assert type(model.head) is nn.Linear and model.head.weight.dtype == torch.bfloat16
    assert isinstance(model.body[0], bnb.nn.Linear4bit) and model.body[0].compute_dtype == torch.bfloat16


def test_default_dtypes() -> None:
    assert BitsandbytesPrecision("int8").dtype == torch.float16
    expected = torch.bfloat16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else torch.float16
    assert BitsandbytesPrecision("nf4").dtype == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"mode": "int4"}, ValueError, "BitsandbytesPrecision(mode='int4'): unknown quantisation mode. Use one of nf4"),
        (
            {"mode": "int8", "dtype": torch.bfloat16},
            ValueError,
            "BitsandbytesPrecision(mode='int8', dtype=torch.bfloat16): 8-bit layers compute in float16",
        ),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=re.escape(message)):
        BitsandbytesPrecision(**kwargs)


def test_a_model_without_linear_layers_is_refused() -> None:
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[BitsandbytesPrecision("nf4")])
    with pytest.raises(TypeError, match=r"with Conv1d: the model has no nn.Linear layers, so nothing would be quant"):
        fabric.setup_module(nn.Conv1d(2, 2, 1))


def test_importing_fabric_loads_no_quantisation_or_deepspeed_package() -> None:
    code = (
        "import sys, fabric, fabric.precision, fabric.strategies\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('bitsandbytes', 'transformer_engine', "
        "'deepspeed')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
