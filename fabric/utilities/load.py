"""Load large checkpoints without reading every tensor into memory first (Lightning's ``_lazy_load``)."""

from __future__ import annotations

from typing import Any

import torch

from fabric.utilities.types import _PATH


class _NotYetLoadedTensor:
    """The placeholder type Lightning's ``_lazy_load`` returns for tensors not read yet; ours never does.

    ``_lazy_load`` below gives real (memory-mapped) tensors instead, so no value is ever of this type. The name
    exists because client code imports it for annotations and type checks (litgpt's checkpoint converters:
    ``hasattr(param, "_load_tensor")`` / ``type(x) is not _NotYetLoadedTensor``), and those stay correct with
    real tensors.
    """

    def _load_tensor(self) -> torch.Tensor:
        raise TypeError(
            "_NotYetLoadedTensor._load_tensor() was called, but fabric's _lazy_load never returns this placeholder: "
            "it returns memory-mapped torch tensors, which are used directly. Use the tensor itself."
        )


def _lazy_load(filename: _PATH) -> Any:
    """Open a ``torch.save`` file with its tensors memory-mapped: bytes are read when a tensor is used.

    Lightning returns placeholder tensors for this; memory-mapped CPU tensors give the same saving
    (``model.load_state_dict(_lazy_load(path))`` copies one tensor at a time) and are real tensors.
    Only the zip format ``torch.save`` has written since torch 1.6 can be mapped. Like ``torch.load``,
    only tensors, containers and primitive types are unpickled (``weights_only=True``).
    """
    try:
        return torch.load(filename, map_location="cpu", mmap=True, weights_only=True)
    except RuntimeError as err:
        if "mmap" not in str(err):
            raise
        raise RuntimeError(
            f"_lazy_load({str(filename)!r}): the file is in torch's legacy (pre-1.6) format, which cannot be "
            "memory-mapped. Load it with torch.load and save it again with torch.save to convert it."
        ) from err


def _materialize_tensors(collection: Any) -> Any:
    """Copy every tensor of ``collection`` into memory, detaching it from the file ``_lazy_load`` mapped."""
    from torch import Tensor

    from fabric.utilities.apply_func import apply_to_collection

    return apply_to_collection(collection, Tensor, lambda tensor: tensor.clone())


def _load_distributed_checkpoint(checkpoint_folder: _PATH) -> dict[str, Any]:
    """Read a sharded (``torch.distributed.checkpoint``) directory into one nested dict, in this process alone.

    The whole checkpoint must fit in CPU memory. This is what ``fabric consolidate`` does.
    """
    # Imported here: the checkpoint machinery lives with the strategies, a layer above the utilities.
    from fabric.checkpoint.sharded import consolidate

    return consolidate(checkpoint_folder)
