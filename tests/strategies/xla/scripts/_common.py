"""Shared by the XLA scripts: a tiny model, its data, and an eager CPU reference loop."""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))


def dataset() -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(32, 4, generator=generator), torch.randn(32, 2, generator=generator)
    )


def eager_cpu_weights(steps_per_epoch: int = 4, epochs: int = 2) -> dict[str, torch.Tensor]:
    """The same loop in plain PyTorch on the CPU."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = torch.utils.data.DataLoader(dataset(), batch_size=32 // steps_per_epoch)
    for _ in range(epochs):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k].float().cpu() - b[k].float().cpu()).abs().max().item() for k in a)


def report(results: dict[str, Any]) -> None:
    """Hand the results to the test: one JSON line on stdout, marked so that log lines do not interfere."""
    sys.stdout.write("RESULTS " + json.dumps(results) + "\n")
