"""DeepSpeed checkpoint directories: recognising them, checking their rank files, consolidating them.

Layout written by `DeepSpeedStrategy.save_checkpoint` (DeepSpeed's native format, tag `checkpoint`):

    path/latest                                         the tag name
    path/checkpoint/mp_rank_00_model_states.pt          stages 0-2: full weights + client state
    path/checkpoint/zero_pp_rank_R_mp_rank_00_*.pt      one optimizer (and, for stage 3, model) shard per rank R
    path/zero_to_fp32.py                                DeepSpeed's own offline consolidation script

Only `consolidate_deepspeed` imports deepspeed, and only when called.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

import torch

from fabric.io._fsspec import local_only
from fabric.utilities.exceptions import FabricValueError

TAG = "checkpoint"
# Client-state entries fabric itself adds, to know later which state keys held the model and the optimizer.
MODULE_KEY = "_fabric_module_key"
OPTIMIZER_KEY = "_fabric_optimizer_key"
_PRIVATE = (MODULE_KEY, OPTIMIZER_KEY)
# What DeepSpeed stores next to the client state in the model-states file.
_DEEPSPEED_ENTRIES = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names", "skipped_steps", "global_steps",
    "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version", "shared_params",
    "ds_autotp_universal_checkpoint", "checkpoint_parallel_dimensions",
})  # fmt: skip
# The classes DeepSpeed itself pickles into its checkpoint files (loss scalers, the ZeRO stage enum, fragment
# addresses): plain data holders, allowed in the safety check that runs before DeepSpeed unpickles the files.
_DEEPSPEED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)
_UNSUPPORTED = re.compile(r"Unsupported operand (\d+)")
_RANK_FILE = re.compile(r"zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")


def is_deepspeed_checkpoint(path: str | Path) -> bool:
    """Whether `path` is a directory that DeepSpeed's `save_checkpoint` wrote (or one whose `latest` file names
    a folder outside it: that is refused by `tag_dir`, not taken for some other kind of checkpoint)."""
    path = Path(path)
    if not path.is_dir():
        return False
    tag = _read_tag(path)
    if tag is not None and not _inside(tag):
        return True
    tag_dir = path / tag if tag else None
    return tag_dir is not None and tag_dir.is_dir() and any(tag_dir.glob("*model_states.pt"))


def tag_dir(path: str | Path, operation: str = "load") -> Path:
    """The directory of the tag named in `path/latest`; a clear error when this is no DeepSpeed checkpoint."""
    path = local_only(path, operation, "DeepSpeed checkpoints")
    if not path.exists():
        raise FileNotFoundError(f"{operation}({str(path)!r}): no such checkpoint. Check the path.")
    tag = _read_tag(path)
    if tag is not None and not _inside(tag):
        raise FabricValueError(
            f"{operation}({str(path)!r}): the checkpoint's 'latest' file names the tag {tag!r}, which is not a "
            "folder inside the checkpoint directory; it is refused rather than followed ('/', '\\', '..' and "
            "absolute paths), so that a crafted checkpoint cannot make this process read files elsewhere. Write the "
            "name of a folder inside the directory into 'latest' (fabric writes 'checkpoint')."
        )
    if not is_deepspeed_checkpoint(path):
        raise FabricValueError(
            f"{operation}({str(path)!r}): not a DeepSpeed checkpoint directory (it needs a 'latest' file naming a "
            "folder with *model_states.pt files, as fabric.save with strategy='deepspeed' writes). Pass such a "
            "directory; a plain checkpoint file loads with the strategy that wrote it."
        )
    return path / tag  # type: ignore[operator]


def check_safe(directory: Path, path: str | Path, weights_only: bool | None, op: str = "load") -> None:
    """Unless `weights_only` is False: refuse the checkpoint if any of its files would import anything beyond
    tensors, plain values and DeepSpeed's own data classes when unpickled. The check reads only each file's
    pickle, statically, and runs nothing; DeepSpeed (and this module) then unpickle the approved files."""
    from fabric.io._load import check_weights_only, refused, unreadable, unsupported

    check_weights_only(weights_only, op)
    if weights_only is False:
        return
    for file in sorted(directory.glob("*.pt")):
        try:
            found = torch.serialization.get_unsafe_globals_in_checkpoint(file)
        except pickle.UnpicklingError as err:
            # An opcode torch's scan does not know (STACK_GLOBAL, INST, OBJ, FRAME, ...): name what it would import.
            code = _UNSUPPORTED.search(str(err))
            if code is None:
                raise unreadable(str(file), op, err) from None
            raise unsupported(str(file), str(path), op, int(code.group(1)), _DEEPSPEED_GLOBALS) from None
        except (ValueError, RuntimeError, KeyError, EOFError) as err:
            raise unreadable(str(file), op, err) from None
        unsafe = sorted(set(found) - _DEEPSPEED_GLOBALS)
        if unsafe:
            raise refused(str(path), op, unsafe)


def read_model_states(directory: Path, path: str | Path, weights_only: bool | None, op: str = "load") -> dict[str, Any]:
    """The first model-states file: DeepSpeed's metadata (world size, stage) and the client state."""
    from fabric.io._load import torch_load

    check_safe(directory, path, weights_only, op)
    file = sorted(directory.glob("*model_states.pt"))[0]
    # check_safe has vetted every global in the file, so the unrestricted unpickler only meets approved ones.
    return torch_load(str(file), str(file), op, "cpu", weights_only=False)


def saved_world_size(states: dict[str, Any]) -> int:
    """How many data-parallel ranks wrote the checkpoint."""
    return int(states.get("dp_world_size", 1))


def saved_stage(states: dict[str, Any]) -> int:
    """The ZeRO stage the checkpoint was written with."""
    config = states.get("ds_config") or {}
    zero = config.get("zero_optimization") or {}
    return int(zero.get("stage", 0)) if isinstance(zero, dict) else 0


def check_rank_files(directory: Path, world_size: int, path: str | Path) -> None:
    """Every rank's optimizer shard must be there; name the first missing one."""
    present = {int(m.group(1)) for f in directory.iterdir() if (m := _RANK_FILE.search(f.name))}
    missing = [rank for rank in range(world_size) if rank not in present]
    if missing:
        name = f"zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt"
        raise FileNotFoundError(
            f"load({str(path)!r}): the checkpoint was written by {world_size} ranks, but the file of rank "
            f"{missing[0]} ({directory / name}) is missing. Copy the complete checkpoint directory."
        )


def client_entries(states: dict[str, Any]) -> dict[str, Any]:
    """The user's non-model, non-optimizer entries saved as DeepSpeed client state."""
    return {k: v for k, v in states.items() if k not in _DEEPSPEED_ENTRIES and k not in _PRIVATE}


def full_weights(
    path: str | Path, exclude_frozen_parameters: bool = False, weights_only: bool | None = None, op: str = "load"
) -> dict[str, torch.Tensor]:
    """The whole model's float32 state dict, assembled from every rank's shard (one process suffices)."""
    directory = tag_dir(path, op)
    states = read_model_states(directory, path, weights_only, op)
    if saved_stage(states) == 0:
        # Without ZeRO the model-states file holds the full module already.
        return {k: v.float() if v.is_floating_point() else v for k, v in states["module"].items()}
    check_rank_files(directory, saved_world_size(states), path)
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # The tag is passed so that DeepSpeed does not read `latest` again on its own (tag_dir has vetted it).
    weights = get_fp32_state_dict_from_zero_checkpoint(
        str(path), tag=directory.name, exclude_frozen_parameters=exclude_frozen_parameters
    )
    return dict(weights)


def consolidate_deepspeed(
    path: str | Path, weights_only: bool | None = None, op: str = "consolidate"
) -> dict[str, Any]:
    """One process, no process group: a plain checkpoint dict {model key: full float32 weights, other entries}.

    The optimizer state is not included: its shards are flat per-rank buffers that no plain optimizer can load.
    `op` is the call the user made (``load`` or ``consolidate``), for the errors.
    """
    directory = tag_dir(path, op)
    states = read_model_states(directory, path, weights_only, op)
    module_key = states.get(MODULE_KEY, "model")
    return {module_key: full_weights(path, weights_only=weights_only, op=op), **client_entries(states)}


def _read_tag(path: Path) -> str | None:
    latest = path / "latest"
    if not latest.is_file():
        return None
    # A tag is a short folder name; a crafted `latest` (huge, not UTF-8) must not decide which error is raised.
    return latest.read_bytes()[:4096].decode("utf-8", "replace").strip() or None


def _inside(tag: str) -> bool:
    """Whether the tag names a folder directly inside the checkpoint directory (one plain path component)."""
    return tag not in (".", "..") and not any(sep in tag for sep in ("/", "\\", "\0")) and not Path(tag).is_absolute()
