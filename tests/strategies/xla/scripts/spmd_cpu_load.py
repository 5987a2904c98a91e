"""Load an xla_spmd checkpoint on the CPU with eager torch, never importing torch_xla: fabric.load and consolidate.

Usage: python spmd_cpu_load.py OUTDIR (holding ckpt/ and expected.pt from the 'checkpoint' scenario).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch import nn

from fabric import Fabric
from fabric.checkpoint.sharded import consolidate


def main() -> None:
    outdir = Path(sys.argv[1])
    expected = torch.load(outdir / "expected.pt", weights_only=True)
    fabric = Fabric(accelerator="cpu", devices=1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    state = {"model": fabric.setup(model, optimizer)[0], "optimizer": optimizer, "step": 0}
    fabric.load(outdir / "ckpt", state)
    params = dict(model.named_parameters())
    whole = consolidate(outdir / "ckpt")
    result = {
        "torch_xla_imported": "torch_xla" in sys.modules,
        "step": state["step"],
        "model_diff": max((params[n] - t).abs().max().item() for n, t in expected["model"].items()),
        "exp_avg_diff": max(
            (optimizer.state[params[n]]["exp_avg"] - t).abs().max().item() for n, t in expected["exp_avg"].items()
        ),
        "consolidated_diff": max((whole["model"][n] - t).abs().max().item() for n, t in expected["model"].items()),
    }
    (outdir / "cpu_result.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
