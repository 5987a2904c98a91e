"""Reads XLA checkpoints where torch_xla cannot be imported: fabric.load on the CPU, and xla_fsdp consolidation."""

from __future__ import annotations

import sys
from pathlib import Path

sys.modules["torch_xla"] = None  # type: ignore[assignment]  # any import of torch_xla now fails

import torch  # noqa: E402
from _common import make_model, max_difference, report  # noqa: E402

from fabric import Fabric  # noqa: E402
from fabric.strategies.xla import consolidate_xla_fsdp_checkpoint  # noqa: E402


def main(kind: str, checkpoint: Path, expected: Path) -> None:
    trained = torch.load(expected, weights_only=True)
    fabric = Fabric(accelerator="cpu")
    model = make_model(seed=5)
    if kind == "sharded":
        merged = consolidate_xla_fsdp_checkpoint(checkpoint, checkpoint.parent / "merged.pt")
        checkpoint = checkpoint.parent / "merged.pt"
        extra = sorted(merged)
    else:
        extra = []
    state = {"model": model}
    remainder = fabric.load(checkpoint, state, strict=False)
    report(
        {
            "difference": max_difference(model.state_dict(), trained),
            "keys": extra,
            "remainder": sorted(remainder),
            "xla_imported": any(name.startswith("torch_xla") and sys.modules[name] for name in sys.modules),
        }
    )


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]))
