"""fabric.save keeps the float16 loss scaler's state, so a resumed run continues exactly where it stopped.

The scaler runs on the CPU here (torch.amp.GradScaler("cpu")) with float16 autocast: the same code path as on a
GPU. A huge initial scale overflows the first steps, so the scale backs off and grows again during the run; a
resumed run that restarted at the initial scale would skip steps the uninterrupted run took.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fabric import Fabric
from fabric.checkpoint.state import SCALER_KEY
from fabric.precision import MixedPrecision

STEPS, STOP = 12, 6


def _fabric() -> Fabric:
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**24, growth_interval=2)
    fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
    fabric.launch()
    return fabric


def _setup(fabric: Fabric) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16)
    return fabric.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9))


def _train(fabric: Fabric, model: Any, optimizer: Any, steps: range) -> list[float]:
    scales = []
    for step in steps:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) * 30
        fabric.backward(model(x).float().pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
        scales.append(fabric.strategy.precision.scaler.get_scale())  # type: ignore[attr-defined]
    return scales


def test_resumed_float16_run_equals_the_uninterrupted_one(tmp_path: Path) -> None:
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    scales = _train(fabric, model, optimizer, range(STEPS))
    assert len(set(scales)) > 2, "the scale must move during the run for the test to mean something"

    first = _fabric()
    model_a, optimizer_a = _setup(first)
    _train(first, model_a, optimizer_a, range(STOP))
    first.save(tmp_path / "ckpt.pt", {"model": model_a, "optimizer": optimizer_a, "step": STOP})

    second = _fabric()
    model_b, optimizer_b = _setup(second)
    state: dict[str, Any] = {"model": model_b, "optimizer": optimizer_b, "step": 0}
    assert second.load(tmp_path / "ckpt.pt", state) == {}, "the scaler's entry is consumed, not returned"
    assert second.strategy.precision.scaler.get_scale() == scales[STOP - 1]  # type: ignore[attr-defined]
    resumed = _train(second, model_b, optimizer_b, range(STOP, STEPS))
    assert resumed == scales[STOP:]
    for resumed_param, param in zip(model_b.parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(resumed_param, param, rtol=0, atol=0)


def test_the_scaler_state_is_a_plain_top_level_entry(tmp_path: Path) -> None:
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    _train(fabric, model, optimizer, range(3))
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    raw = torch.load(tmp_path / "ckpt.pt", weights_only=True)  # loadable without fabric
    assert raw[SCALER_KEY] == fabric.strategy.precision.state_dict()
    assert fabric.load(tmp_path / "ckpt.pt")[SCALER_KEY] == raw[SCALER_KEY], "a load without state returns all"


def test_no_scaler_entry_without_an_optimizer_or_a_scaler(tmp_path: Path) -> None:
    fabric = _fabric()
    model, _ = _setup(fabric)
    fabric.save(tmp_path / "weights.pt", {"model": model})
    assert SCALER_KEY not in torch.load(tmp_path / "weights.pt", weights_only=True)
    plain = Fabric(accelerator="cpu", devices=1)
    plain_model, plain_optimizer = _setup(plain)
    plain.save(tmp_path / "fp32.pt", {"model": plain_model, "optimizer": plain_optimizer})
    assert SCALER_KEY not in torch.load(tmp_path / "fp32.pt", weights_only=True)


def test_a_users_own_entry_under_the_key_is_kept(tmp_path: Path) -> None:
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer, SCALER_KEY: {"mine": 1}})
    assert torch.load(tmp_path / "ckpt.pt", weights_only=True)[SCALER_KEY] == {"mine": 1}
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, SCALER_KEY: None}
    fabric.load(tmp_path / "ckpt.pt", state)
    assert state[SCALER_KEY] == {"mine": 1}


@pytest.mark.usefixtures("no_cluster_env")
def test_a_float32_run_resumes_from_a_float16_checkpoint(tmp_path: Path) -> None:
    fabric = _fabric()
    model, optimizer = _setup(fabric)
    fabric.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})
    plain = Fabric(accelerator="cpu", devices=1)
    plain_model, plain_optimizer = _setup(plain)
    assert plain.load(tmp_path / "ckpt.pt", {"model": plain_model, "optimizer": plain_optimizer}) == {}
