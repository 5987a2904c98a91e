"""DeepSpeed's config from a user config and Lightning keywords; what DeepSpeed cannot run. No deepspeed import."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import torch

from fabric.utilities.exceptions import FabricTypeError, FabricValueError

# Keyword -> (where it lives in DeepSpeed's config, default used when no config is passed).
# Offload and fp16 entries apply only when their section is in use; see `_applies`.
ZERO_KEYWORDS: dict[str, tuple[tuple[str, ...], Any]] = {
    "contiguous_gradients": (("zero_optimization", "contiguous_gradients"), True),
    "overlap_comm": (("zero_optimization", "overlap_comm"), True),
    "allgather_partitions": (("zero_optimization", "allgather_partitions"), True),
    "reduce_scatter": (("zero_optimization", "reduce_scatter"), True),
    "allgather_bucket_size": (("zero_optimization", "allgather_bucket_size"), 200_000_000),
    "reduce_bucket_size": (("zero_optimization", "reduce_bucket_size"), 200_000_000),
    "sub_group_size": (("zero_optimization", "sub_group_size"), 1_000_000_000_000),
}
OFFLOAD_OPTIMIZER_KEYWORDS: dict[str, tuple[tuple[str, ...], Any]] = {
    "offload_optimizer_device": (("zero_optimization", "offload_optimizer", "device"), "cpu"),
    "pin_memory": (("zero_optimization", "offload_optimizer", "pin_memory"), False),
    "optimizer_buffer_count": (("zero_optimization", "offload_optimizer", "buffer_count"), 4),
}
OFFLOAD_PARAM_KEYWORDS: dict[str, tuple[tuple[str, ...], Any]] = {
    "offload_params_device": (("zero_optimization", "offload_param", "device"), "cpu"),
    "params_buffer_count": (("zero_optimization", "offload_param", "buffer_count"), 5),
    "params_buffer_size": (("zero_optimization", "offload_param", "buffer_size"), 100_000_000),
    "max_in_cpu": (("zero_optimization", "offload_param", "max_in_cpu"), 1_000_000_000),
}
FP16_KEYWORDS: dict[str, tuple[tuple[str, ...], Any]] = {
    "loss_scale": (("fp16", "loss_scale"), 0.0),
    "initial_scale_power": (("fp16", "initial_scale_power"), 16),
    "loss_scale_window": (("fp16", "loss_scale_window"), 1000),
    "hysteresis": (("fp16", "hysteresis"), 2),
    "min_loss_scale": (("fp16", "min_loss_scale"), 1),
}
OTHER_KEYWORDS: dict[str, tuple[tuple[str, ...], Any]] = {
    "zero_allow_untested_optimizer": (("zero_allow_untested_optimizer",), True),
    "logging_batch_size_per_gpu": (("train_micro_batch_size_per_gpu",), 1),
    "partition_activations": (("activation_checkpointing", "partition_activations"), False),
    "cpu_checkpointing": (("activation_checkpointing", "cpu_checkpointing"), False),
    "contiguous_memory_optimization": (("activation_checkpointing", "contiguous_memory_optimization"), False),
    "synchronize_checkpoint_boundary": (("activation_checkpointing", "synchronize_checkpoint_boundary"), False),
}
ALL_KEYWORDS = {**ZERO_KEYWORDS, **OFFLOAD_OPTIMIZER_KEYWORDS, **OFFLOAD_PARAM_KEYWORDS, **FP16_KEYWORDS,
                **OTHER_KEYWORDS}  # fmt: skip

# Fabric precision -> the DeepSpeed section that must be enabled (None: plain float32).
PRECISION_SECTIONS: dict[str, str | None] = {
    "32-true": None,
    "16-mixed": "fp16",
    "16-true": "fp16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16",
}

# Config keys of the 16-bit sections and the section each one is; "bfloat16" is DeepSpeed's older spelling of bf16.
_SECTION_KEYS = (("fp16", "fp16"), ("bf16", "bf16"), ("bfloat16", "bf16"))


def read_config(config: str | Path | dict[str, Any] | None) -> dict[str, Any] | None:
    """A deep copy of a config dict, or the parsed JSON file at a path."""
    if config is None:
        return None
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if not isinstance(config, (str, Path)):
        raise FabricTypeError(
            f"DeepSpeedStrategy(config={type(config).__name__}): expected a dict or the path to a JSON file. "
            "Pass one of them."
        )
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(
            f"DeepSpeedStrategy(config={str(config)!r}): no such file. Pass the path to a DeepSpeed JSON config, "
            "or the config as a dict."
        )
    try:
        loaded = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise FabricValueError(
            f"DeepSpeedStrategy(config={str(config)!r}): not valid JSON ({err}). Fix the file."
        ) from None
    if not isinstance(loaded, dict):
        raise FabricValueError(f"DeepSpeedStrategy(config={str(config)!r}): the JSON is not an object. Fix the file.")
    return loaded


def build_config(
    user_config: dict[str, Any] | None,
    zero_optimization: bool | None,
    stage: int | None,
    offload_optimizer: bool | None,
    offload_parameters: bool | None,
    keywords: dict[str, Any],
) -> dict[str, Any]:
    """Merge keywords into the user's config; without a config, unset keywords take Lightning's defaults.

    A keyword that was passed (not None) and that the config sets to another value is an error naming both.
    """
    defaults = user_config is None
    config: dict[str, Any] = {} if user_config is None else user_config
    if stage is not None and stage not in (0, 1, 2, 3):
        raise FabricValueError(f"DeepSpeedStrategy(stage={stage!r}): ZeRO has stages 0, 1, 2 and 3. Pass one of them.")
    if zero_optimization is False and stage not in (None, 0):
        raise FabricValueError(
            f"DeepSpeedStrategy(zero_optimization=False, stage={stage}): a ZeRO stage was chosen with ZeRO turned off. "
            "Drop zero_optimization=False, or pass stage=0."
        )
    if zero_optimization is False:
        stage = 0
    elif stage is None and defaults:
        stage = 2
    _merge(config, ("zero_optimization", "stage"), stage, "stage")
    zero_stage = get_path(config, ("zero_optimization", "stage")) or 0
    if offload_parameters and zero_stage != 3:
        raise FabricValueError(
            f"DeepSpeedStrategy(offload_parameters=True, stage={zero_stage}): parameters can only be offloaded with "
            "ZeRO stage 3. Pass stage=3, or drop offload_parameters."
        )
    _merge_offload(config, "offload_optimizer", offload_optimizer, OFFLOAD_OPTIMIZER_KEYWORDS, keywords, defaults)
    _merge_offload(config, "offload_param", offload_parameters, OFFLOAD_PARAM_KEYWORDS, keywords, defaults)
    for table in (ZERO_KEYWORDS, OTHER_KEYWORDS):
        for name, (path, default) in table.items():
            value = keywords.get(name)
            if name in ZERO_KEYWORDS and zero_stage == 0:
                continue
            if value is None and defaults:
                value = default
            _merge(config, path, value, name)
    if "train_batch_size" not in config:
        # DeepSpeed refuses to start without a batch size; it only uses it for throughput logs here.
        config.setdefault("train_micro_batch_size_per_gpu", 1)
    return config


def _merge_offload(
    config: dict[str, Any],
    section: str,
    enabled: bool | None,
    table: dict[str, tuple[tuple[str, ...], Any]],
    keywords: dict[str, Any],
    defaults: bool,
) -> None:
    flag = "offload_optimizer" if section == "offload_optimizer" else "offload_parameters"
    device = get_path(config, ("zero_optimization", section, "device"))
    in_config = device not in (None, "none")
    if enabled is False and in_config:
        raise FabricValueError(
            f"DeepSpeedStrategy({flag}=False, config['zero_optimization']['{section}']['device']={device!r}): "
            "the keyword and the config disagree. Set it in one place only."
        )
    if not (enabled or in_config):
        return
    for name, (path, default) in table.items():
        value = keywords.get(name)
        if value is None and (defaults or not in_config):
            value = default
        _merge(config, path, value, name)


def apply_precision(config: dict[str, Any], precision: str) -> dict[str, Any]:
    """Enable DeepSpeed's fp16 or bf16 section for a fabric precision; contradictions name both values."""
    if precision not in PRECISION_SECTIONS:
        raise FabricValueError(
            f"Fabric(strategy='deepspeed', precision={precision!r}): DeepSpeed cannot train in this precision. "
            f"Use one of {', '.join(PRECISION_SECTIONS)}."
        )
    wanted = PRECISION_SECTIONS[precision]
    _resolve_auto(config, wanted)
    for key, section in _SECTION_KEYS:
        enabled = bool(get_path(config, (key, "enabled")))
        if enabled and section != wanted:
            raise FabricValueError(
                f"Fabric(strategy=DeepSpeedStrategy(config={{'{key}': {{'enabled': True}}}}), "
                f"precision={precision!r}): the DeepSpeed config and the precision disagree. Pass the matching "
                f"precision ({'16-mixed' if section == 'fp16' else 'bf16-mixed'}) or remove '{key}' from the "
                "config."
            )
    if wanted is not None:
        key = "bfloat16" if wanted == "bf16" and "bfloat16" in config and "bf16" not in config else wanted
        config.setdefault(key, {})["enabled"] = True
    return config


def _resolve_auto(config: dict[str, Any], wanted: str | None) -> None:
    """`"enabled": "auto"` (HF Accelerate / Transformers configs) means: on exactly when the precision uses it.

    A non-empty string is truthy, so without this an "auto" section would count as enabled whatever the precision.
    DeepSpeed spells bf16 also as "bfloat16"; both spellings are resolved.
    """
    for key, section in _SECTION_KEYS:
        node = config.get(key)
        if isinstance(node, dict) and node.get("enabled") == "auto":
            node["enabled"] = section == wanted


def apply_fp16_keywords(config: dict[str, Any], keywords: dict[str, Any], defaults: bool) -> None:
    """Loss-scaling keywords only mean something when fp16 is on."""
    if not get_path(config, ("fp16", "enabled")):
        return
    for name, (path, default) in FP16_KEYWORDS.items():
        value = keywords.get(name)
        _merge(config, path, default if value is None and defaults else value, name)


def zero_stage(config: dict[str, Any]) -> int:
    """The ZeRO stage a config selects (0 when it has none)."""
    return int(get_path(config, ("zero_optimization", "stage")) or 0)


def get_path(config: dict[str, Any], path: tuple[str, ...]) -> Any:
    """config[path[0]][path[1]]..., or None where a level is missing."""
    node: Any = config
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _merge(config: dict[str, Any], path: tuple[str, ...], value: Any, keyword: str) -> None:
    if value is None:
        return
    existing = get_path(config, path)
    if existing is not None and existing != value:
        where = "".join(f"[{key!r}]" for key in path)
        raise FabricValueError(
            f"DeepSpeedStrategy({keyword}={value!r}, config{where}={existing!r}): the keyword and the config "
            "disagree. Set it in one place only."
        )
    node = config
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value


def check_device_indices(devices: list[torch.device]) -> None:
    """DeepSpeed puts local rank i on cuda:i (from LOCAL_RANK, also inside zero.Init), whatever index was chosen.

    Running elsewhere would split the model and the batches over two GPUs, so other indices are refused with the
    way to get them: make the chosen GPUs the only visible ones, then they are cuda:0, cuda:1, ...
    """
    chosen = [device.index for device in devices if device.type == "cuda"]
    if chosen == list(range(len(chosen))):
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [str(index) for index in chosen]
    if visible:
        # The indices count within what is already visible; the fix must name the physical GPUs.
        names = [name.strip() for name in visible.split(",")]
        physical = [names[index] if index < len(names) else str(index) for index in chosen]
    listed = ",".join(physical)
    raise FabricValueError(
        f"Fabric(strategy='deepspeed', devices={chosen}): DeepSpeed places local rank i on cuda:i and cannot use "
        f"other GPU indices. Make the chosen GPUs the visible ones and count them instead: start with "
        f"CUDA_VISIBLE_DEVICES={listed} and pass devices={len(chosen)}."
    )


def check_dtype_supported(precision: str, ds_accelerator: Any) -> None:
    """DeepSpeed's CPU accelerator has float16 only where oneDNN supports it; say so before the engine fails."""
    if precision.startswith("16-") and not ds_accelerator.is_fp16_supported():
        dtype, instead = "float16", "precision='bf16-mixed' (or 'bf16-true', '32-true')"
    elif precision.startswith("bf16-") and not ds_accelerator.is_bf16_supported():
        dtype, instead = "bfloat16", "precision='16-mixed' (or '32-true')"
    else:
        return
    raise RuntimeError(
        f"Fabric(strategy='deepspeed', precision={precision!r}): DeepSpeed's {ds_accelerator.device_name()!r} "
        f"accelerator has no {dtype} support on this machine. Use {instead}."
    )
