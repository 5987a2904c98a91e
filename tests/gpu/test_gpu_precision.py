"""Precision on one GPU, in the pytest process: 16-mixed end to end (scale, unscale, clip, inf-skip, resumed scaler
state), 16-true and bf16-true, and a checkpoint of CUDA tensors. Skipped with the reason where no GPU is visible.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from _gpu import needs_gpus
from torch import nn

from fabric import Fabric

pytestmark = [pytest.mark.cuda, needs_gpus(1), pytest.mark.usefixtures("no_cluster_env")]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


@pytest.fixture
def fp16() -> Iterator[Fabric]:
    fabric = Fabric(accelerator="cuda", devices=1, precision="16-mixed")
    fabric.launch()
    yield fabric
    fabric.strategy.teardown()


def _setup(fabric: Fabric) -> tuple[Any, Any]:
    model = _model()
    return fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_16_mixed_scales_unscales_clips_and_skips_inf_steps(fp16: Fabric) -> None:
    scaler = fp16.strategy.precision.scaler  # type: ignore[attr-defined]
    assert isinstance(scaler, torch.amp.GradScaler) and scaler.get_scale() == 65536.0
    model, optimizer = _setup(fp16)
    reference = copy.deepcopy(model.module).cuda()
    x = torch.randn(8, 16, device=fp16.device)
    with torch.autocast("cuda", dtype=torch.float16):
        reference(x).float().pow(2).mean().backward()
    expected = [p.grad.float() for p in reference.parameters()]

    loss = model(x).float().pow(2).mean()
    fp16.backward(loss)
    scaled = [p.grad.float() for p in model.parameters()]
    for got, want in zip(scaled, expected, strict=True):
        torch.testing.assert_close(got / 65536.0, want, rtol=1e-2, atol=1e-4)  # scaled by 2**16
    true_norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in expected]))
    norm = fp16.clip_gradients(model, optimizer, max_norm=true_norm.item() / 2)  # unscales first
    torch.testing.assert_close(norm.float(), true_norm, rtol=1e-2, atol=1e-4)
    clipped = torch.linalg.vector_norm(torch.stack([p.grad.float().norm() for p in model.parameters()]))
    torch.testing.assert_close(clipped, true_norm / 2, rtol=1e-2, atol=1e-4)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    optimizer.zero_grad()
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "a finite step"

    before = [p.detach().clone() for p in model.parameters()]
    fp16.backward(model(x).float().pow(2).mean() * float("inf"))
    optimizer.step()
    optimizer.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True)), "inf step skipped"
    assert scaler.get_scale() == 65536.0 / 2


def test_16_mixed_resumes_the_scaler_state(fp16: Fabric, tmp_path: Path) -> None:
    model, optimizer = _setup(fp16)
    x = torch.randn(8, 16, device=fp16.device)
    for factor in (float("inf"), float("inf"), 1.0):  # two skipped steps: the scale is now 2**14
        fp16.backward(model(x).float().pow(2).mean() * factor)
        optimizer.step()
        optimizer.zero_grad()
    saved = fp16.strategy.precision.state_dict()
    assert saved["scale"] == 2.0**14
    fp16.save(tmp_path / "ckpt.pt", {"model": model, "optimizer": optimizer})

    other = Fabric(accelerator="cuda", devices=1, precision="16-mixed")
    other.launch()
    model_b, optimizer_b = _setup(other)
    assert other.load(tmp_path / "ckpt.pt", {"model": model_b, "optimizer": optimizer_b}) == {}
    assert other.strategy.precision.state_dict() == saved
    assert all(p.device.type == "cuda" for p in model_b.parameters())


@pytest.mark.parametrize(("precision", "dtype"), [("16-true", torch.float16), ("bf16-true", torch.bfloat16)])
def test_true_half_precision_trains_in_the_16_bit_dtype(precision: str, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    fabric = Fabric(accelerator="cuda", devices=1, precision=precision)
    fabric.launch()
    with fabric.init_module():
        built = nn.Linear(16, 4)
    assert (built.weight.device.type, built.weight.dtype) == ("cuda", dtype)
    model, optimizer = _setup(fabric)
    assert {p.dtype for p in model.parameters()} == {dtype}
    x = torch.randn(8, 16, device=fabric.device)
    losses = []
    for _ in range(5):
        out = model(x)
        assert out.dtype == torch.float32, "outputs come back in the default dtype"
        loss = out.pow(2).mean()
        fabric.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    fabric.strategy.teardown()


def test_bf16_mixed_autocasts_on_the_gpu() -> None:
    if not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    fabric = Fabric(accelerator="cuda", devices=1, precision="bf16-mixed")
    fabric.launch()
    model, _ = _setup(fabric)
    with fabric.autocast():
        assert model.module(torch.randn(2, 16, device=fabric.device)).dtype == torch.bfloat16
    assert fabric.strategy.precision.state_dict() == {}, "bfloat16 needs no scaler"
    fabric.strategy.teardown()
