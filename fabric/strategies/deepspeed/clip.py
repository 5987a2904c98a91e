"""Gradient-norm clipping for DeepSpeed: the global norm over every rank's shard, applied inside engine.step.

After backward, ZeRO holds the reduced gradients in flat per-rank partitions that only its optimizer wrapper
sees, so clipping `param.grad` as for DDP would clip nothing (or one shard by its local norm). Instead the norm
is computed the way DeepSpeed's own step computes it, and the wrapper's `clip_grad` is set for the next step,
which then scales every shard by the same global factor.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from fabric.utilities.exceptions import FabricValueError

if TYPE_CHECKING:
    from deepspeed import DeepSpeedEngine


def clip_next_step(
    engine: DeepSpeedEngine, max_norm: float, norm_type: float, error_if_nonfinite: bool
) -> tuple[Tensor, bool]:
    """The total gradient norm now; True when the clipping happens inside the next engine.step()."""
    if norm_type != 2.0:
        raise FabricValueError(
            f"fabric.clip_gradients(norm_type={norm_type}): DeepSpeed computes only the L2 norm of its sharded "
            "gradients. Pass norm_type=2."
        )
    if max_norm <= 0:
        raise FabricValueError(
            f"fabric.clip_gradients(max_norm={max_norm}): the norm limit must be > 0. Pass e.g. 1.0."
        )
    optimizer = engine.optimizer
    if not hasattr(optimizer, "clip_grad"):
        # No ZeRO and float32: DeepSpeed steps the user's optimizer, and param.grad holds the averaged gradients.
        params = [p for p in engine.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm, error_if_nonfinite=error_if_nonfinite)
        return norm, False
    norm = _global_norm(optimizer).detach().float().reshape(())
    fp16 = bool(engine.fp16_enabled())
    # With fp16 loss scaling, inf/nan norms are expected: DeepSpeed skips that step and lowers the scale.
    if error_if_nonfinite and not fp16 and not torch.isfinite(norm):
        raise RuntimeError(
            f"fabric.clip_gradients(max_norm={max_norm}): the total gradient norm is {norm.item()}, so clipping "
            "would give nan weights. Check the loss for inf/nan, or pass error_if_nonfinite=False."
        )
    optimizer.clip_grad = max_norm
    return norm, True


def _global_norm(optimizer: Any) -> Tensor:
    """The unscaled L2 norm of all gradients, summed over every rank's partition."""
    from deepspeed.runtime import utils as ds_utils

    if hasattr(optimizer, "scaled_global_norm"):  # ZeRO stages 1 and 2
        return torch.as_tensor(optimizer.scaled_global_norm()) / optimizer.loss_scale
    if hasattr(optimizer, "_get_norm_groups"):  # ZeRO stage 3
        return torch.as_tensor(ds_utils.combine_grad_norm_groups(optimizer._get_norm_groups())) / optimizer.loss_scale
    if hasattr(optimizer, "get_grads_for_norm"):  # bf16 without ZeRO
        grads, _ = optimizer.get_grads_for_norm()
        return torch.as_tensor(ds_utils.get_global_norm_of_tensors(grads, mpu=optimizer.mpu, norm_type=2.0))
    raise NotImplementedError(
        f"fabric.clip_gradients(max_norm=...): fabric cannot read the gradient norm of DeepSpeed's "
        f"{type(optimizer).__name__}. Set 'gradient_clipping' in the DeepSpeed config instead."
    )
