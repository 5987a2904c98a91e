"""XLACheckpointIO: torch.save of checkpoints whose tensors live on XLA devices, written as CPU tensors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fabric.io.torch_io import TorchCheckpointIO


def xla_state_to_cpu(checkpoint: Any) -> Any:
    """`checkpoint` with every XLA tensor copied to the CPU, after running the pending XLA computation.

    A file holding XLA tensors needs torch_xla to be read; a CPU copy loads anywhere, including machines without it.
    """
    from fabric.utilities.apply_func import apply_to_collection

    def has_xla(value: Any) -> bool:
        found = []
        apply_to_collection(value, torch.Tensor, lambda t: found.append(t.device.type == "xla"))
        return any(found)

    if not has_xla(checkpoint):
        return checkpoint
    import torch_xla

    # The lazy tensors hold a graph, not values, until the graph runs; run it once for all of them.
    torch_xla.sync()
    return apply_to_collection(checkpoint, torch.Tensor, lambda t: t.cpu() if t.device.type == "xla" else t)


class XLACheckpointIO(TorchCheckpointIO):
    """TorchCheckpointIO that first moves XLA tensors to the CPU, so the file loads without torch_xla."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Write `checkpoint` with its XLA tensors as CPU tensors (atomically, as TorchCheckpointIO does)."""
        super().save_checkpoint(xla_state_to_cpu(checkpoint), path, storage_options=storage_options)
