"""The sharded checkpoint format of `xla_fsdp`, and its consolidation into one plain file (needs no torch_xla).

A sharded checkpoint is a directory holding one file per process, `checkpoint_rank-RRRRRRRR-of-WWWWWWWW.pth` (the
names Lightning uses), each a dict with the process's shard of the model's state under the model's key, its
optimizer state, the plain entries, and `shard_metadata` (XlaFullyShardedDataParallel.get_shard_metadata()), plus
`xla_fsdp.json`, which names the model's key. Every tensor in it is a CPU tensor.

Consolidation concatenates each parameter's shards in rank order, drops the padding, restores the parameter's
shape and name (unflattening flattened parameters), and strips the wrappers' prefixes: the result loads into the
plain, unwrapped model on any machine. Optimizer state stays sharded (it is laid out per shard) and is left out.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

METADATA_FILE = "xla_fsdp.json"
SHARD_METADATA_KEY = "shard_metadata"
_FORMAT = "fabric-xla-fsdp"
_SHARD_FILE = re.compile(r"checkpoint_rank-(\d{8})-of-(\d{8})\.pth")
# Name parts XlaFullyShardedDataParallel adds: its shards, its wrapped module, the flatten wrapper's module.
_SHARD_PREFIX = "_fsdp_shard"
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_fpw_module.")


def shard_file(directory: Path, rank: int, world_size: int) -> Path:
    """The file of `rank`'s shard."""
    return directory / f"checkpoint_rank-{rank:08d}-of-{world_size:08d}.pth"


def write_metadata(directory: Path, module_key: str, world_size: int) -> None:
    """Record which entry holds the model, and how many shards there are."""
    text = json.dumps({"format": _FORMAT, "module_key": module_key, "world_size": world_size})
    (directory / METADATA_FILE).write_text(text)


def is_xla_fsdp_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a directory of xla_fsdp shards (written by fabric, or by Lightning without the json)."""
    directory = Path(path)
    if not directory.is_dir():
        return False
    return (directory / METADATA_FILE).is_file() or any(_SHARD_FILE.fullmatch(p.name) for p in directory.iterdir())


def read_shards(path: str | Path, weights_only: bool | None = None) -> tuple[str, list[dict[str, Any]]]:
    """The model's key and every rank's shard file, in rank order; raises when shards are missing."""
    directory = Path(path)
    files = sorted(p for p in directory.iterdir() if _SHARD_FILE.fullmatch(p.name))
    if not files:
        raise FileNotFoundError(
            f"consolidate({str(path)!r}): no 'checkpoint_rank-*-of-*.pth' shard files are in this directory. Pass "
            "the directory fabric.save wrote with strategy='xla_fsdp'."
        )
    world_size = int(_SHARD_FILE.fullmatch(files[0].name).group(2))  # type: ignore[union-attr]
    expected = [shard_file(directory, rank, world_size) for rank in range(world_size)]
    missing = [p.name for p in expected if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"consolidate({str(path)!r}): the checkpoint was written by {world_size} processes, but the shards "
            f"{missing} are missing. Copy every process's shard into this directory (on several hosts, each host "
            "wrote its own processes' shards)."
        )
    module_key = "model"  # Lightning writes no metadata file and keeps the model under this key.
    if (directory / METADATA_FILE).is_file():
        module_key = json.loads((directory / METADATA_FILE).read_text())["module_key"]
    safe = weights_only is None or weights_only
    shards = [torch.load(p, map_location="cpu", weights_only=safe) for p in expected]
    return module_key, shards


def consolidate_xla_fsdp_checkpoint(
    path: str | Path, output: str | Path | None = None, weights_only: bool | None = None
) -> dict[str, Any]:
    """Merge an `xla_fsdp` sharded checkpoint directory into one checkpoint of full, unwrapped weights.

    Returns ``{model_key: full_state_dict, **plain_entries}`` (the plain entries as rank 0 saved them; optimizer
    state is left out because it is sharded). With ``output``, also writes it there with torch.save, so that
    ``fabric.load(output, {"model": model})`` or ``torch.load`` read it on any machine, torch_xla or not.
    """
    module_key, shards = read_shards(path, weights_only)
    metadata = shards[0][SHARD_METADATA_KEY]
    full = consolidate_module_state([shard[module_key] for shard in shards], metadata)
    result: dict[str, Any] = {module_key: full}
    for key, value in shards[0].items():
        if key not in (module_key, SHARD_METADATA_KEY) and not is_optimizer_state(value):
            result[key] = value
    if output is not None:
        torch.save(result, output)
    return result


def consolidate_module_state(shards: list[dict[str, Tensor]], metadata: dict[str, Any]) -> dict[str, Tensor]:
    """The full state dict of the unwrapped model from every rank's sharded state dict (in rank order)."""
    if len(shards) != metadata["world_size"]:
        raise ValueError(
            f"consolidate: {len(shards)} shards were given, but the model was sharded over {metadata['world_size']} "
            "processes. Pass every rank's shard, in rank order."
        )
    full: dict[str, Tensor] = {}
    buffers = metadata.get("buffer_info", {})
    for name, first in shards[0].items():
        prefix, suffix = _split_shard_name(name)
        if suffix is None:
            # Buffers are not sharded: rank 0's copy, in the dtype it had before wrapping.
            full[name] = first.to(buffers[name]["_orig_dtype"]) if name in buffers else first
            continue
        info = metadata["shard_info"][prefix][suffix]
        joined = torch.cat([shard[name] for shard in shards], dim=0)
        size = torch.Size(info["_orig_size"])
        # Shards are flat and padded to equal length, unless the model was sharded along dim 0.
        value = joined[: math.prod(size)].view(size) if joined.dim() == 1 else joined[: size[0]]
        full[_join(prefix, info["_orig_name"])] = value
    _unflatten(full, metadata.get("flatten_info", {}))
    return {_strip_wrappers(name): value for name, value in full.items()}


def _split_shard_name(name: str) -> tuple[str, str | None]:
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.startswith(_SHARD_PREFIX):
            return ".".join(parts[:index]), ".".join(parts[index:])
    return name, None


def _unflatten(full: dict[str, Tensor], flatten_info: dict[str, Any]) -> None:
    """Split flattened parameters (flatten_parameters=True) back into the parameters they hold."""
    for name in [n for n in full if "_fsdp_wrapped_module.flat_param_" in n]:
        names, shapes, numels = flatten_info[name]
        prefix = name.rpartition(".")[0]
        for sub_name, shape, piece in zip(names, shapes, full.pop(name).split(list(numels)), strict=True):
            full[_join(prefix, sub_name)] = piece.view(shape)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _strip_wrappers(name: str) -> str:
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    return name


def is_optimizer_state(value: Any) -> bool:
    """Whether `value` looks like an optimizer's state_dict (sharded, per parameter shard)."""
    return isinstance(value, dict) and set(value) == {"state", "param_groups"}
