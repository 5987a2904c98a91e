"""The precision of FSDP2 (`fully_shard`) runs: the usual policy, plus the MixedPrecisionPolicy sharding needs."""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric.precision._delegating import _DelegatingPrecision
from fabric.precision.precision import Precision
from fabric.utilities.exceptions import FabricValueError

if TYPE_CHECKING:
    from torch.distributed.fsdp import MixedPrecisionPolicy

# The names FSDP can honour on sharded parameters; a custom plugin's policy has no MixedPrecisionPolicy equivalent.
SUPPORTED_PRECISIONS = ("32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true")
_LIGHTNING_DTYPES = {
    "16-true": torch.float16,
    "16-mixed": torch.float16,
    "bf16-true": torch.bfloat16,
    "bf16-mixed": torch.bfloat16,
    "32-true": torch.float32,
}
_MIXED_DTYPES = {"16-mixed": torch.float16, "bf16-mixed": torch.bfloat16}


class FSDPPrecision(_DelegatingPrecision):
    """A precision for sharded parameters: `*-mixed` computes in 16 bits through fully_shard's MixedPrecisionPolicy
    while the shards and the gradient reduction stay float32; `*-true` and `64-true` cast the model before sharding.

    float16 on CUDA scales the loss with a ShardedGradScaler, which agrees across ranks on inf/nan gradients (a
    plain GradScaler sees only this rank's shards, so ranks could disagree on whether to step).
    """

    def __init__(
        self,
        precision: Literal["32-true", "64-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true"],
        device: str = "cuda",
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if precision not in SUPPORTED_PRECISIONS:
            raise FabricValueError(
                f"FSDPPrecision(precision={precision!r}): sharded parameters only support the policies "
                f"{', '.join(SUPPORTED_PRECISIONS)}. Use one of these names."
            )
        if scaler is not None and precision != "16-mixed":
            raise FabricValueError(
                f"FSDPPrecision(precision={precision!r}, scaler=...): only float16 mixed precision scales the "
                "loss. Drop the scaler, or use precision='16-mixed'."
            )
        self.precision = precision
        self.device = device
        self._policy = _standard_plugin(precision, device, scaler)
        self.changes_forward = self._policy.changes_forward

    @property
    def mixed_precision_config(self) -> MixedPrecisionPolicy | None:
        """Lightning's table: param, reduce and buffer dtype all equal the precision's dtype (float16 for `16-*`,
        bfloat16 for `bf16-*`, float32 for `32-true`); None for `64-true`, which Lightning rejects.

        An FSDP2 `MixedPrecisionPolicy` with a `buffer_dtype` field added. It describes the plugin only: the
        strategy shards with `mixed_precision_policy()` below, which reduces gradients in float32.
        """
        dtype = _LIGHTNING_DTYPES.get(self.precision)
        return None if dtype is None else _config_class()(param_dtype=dtype, reduce_dtype=dtype, buffer_dtype=dtype)  # type: ignore[call-arg]

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler (a ShardedGradScaler for float16 on CUDA), or None."""
        return getattr(self._policy, "scaler", None)

    @property
    def requires_fabric_backward(self) -> bool:
        """With a loss scaler, the loss must be scaled before backward."""
        return self._policy.requires_fabric_backward

    @property
    def has_loss_scaler(self) -> bool:
        """Whether a scaler may skip steps with inf/nan gradients."""
        return self._policy.has_loss_scaler

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Scale (float16), then backward."""
        self._policy.backward(tensor, module, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizer, **kwargs: Any) -> Any:
        """Step, through the scaler when there is one."""
        return self._policy.optimizer_step(optimizer, **kwargs)

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        """Unscale so clipping sees true norms."""
        self._policy.unscale_gradients(optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state."""
        return self._policy.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the scaler's state."""
        self._policy.load_state_dict(state_dict)

    def teardown(self) -> None:
        """Undo process-wide changes."""
        self._policy.teardown()


def mixed_precision_policy(precision: str) -> MixedPrecisionPolicy | None:
    """`*-mixed`: compute in the 16-bit dtype, keep float32 shards and reduce gradients in float32.

    `*-true` and `64-true` need no policy: the precision plugin already cast the whole module before sharding.
    """
    dtype = _MIXED_DTYPES.get(precision)
    if dtype is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


@functools.cache
def _config_class() -> type[MixedPrecisionPolicy]:
    # Built on first use: importing torch.distributed.fsdp costs time that `import fabric` must not pay.
    from torch.distributed.fsdp import MixedPrecisionPolicy

    @dataclasses.dataclass(frozen=True)
    class FSDPMixedPrecisionConfig(MixedPrecisionPolicy):
        """FSDP2's policy plus FSDP1's `buffer_dtype`, the three dtypes Lightning's `mixed_precision_config` has."""

        buffer_dtype: torch.dtype | None = None

    return FSDPMixedPrecisionConfig


def check_fsdp_precision(precision: Precision, owner: str) -> None:
    """Reject a precision plugin whose policy FSDP cannot reproduce on sharded parameters."""
    name = getattr(precision, "precision", None)
    if name not in SUPPORTED_PRECISIONS:
        raise FabricValueError(
            f"{owner}(precision={type(precision).__name__} with precision={name!r}): sharded parameters only "
            f"support the policies {', '.join(SUPPORTED_PRECISIONS)}, which map to FSDP's MixedPrecisionPolicy. "
            "Use one of these names, or precision='32-true' with mixed_precision=MixedPrecisionPolicy(...)."
        )


def as_fsdp_precision(precision: Precision, owner: str) -> Precision:
    """The plugin a sharded strategy runs with: fabric's standard plugins become an FSDPPrecision of that name.

    A user's own subclass is kept as it is (its name was checked); only a plain GradScaler would be wrong there,
    and fabric's MixedPrecision is the one that builds it.
    """
    check_fsdp_precision(precision, owner)
    from fabric.precision.amp import MixedPrecision
    from fabric.precision.double import DoublePrecision
    from fabric.precision.half import HalfPrecision

    if type(precision) not in (Precision, MixedPrecision, HalfPrecision, DoublePrecision):
        return precision
    device = getattr(precision, "device", "cuda")
    scaler = getattr(precision, "scaler", None)
    if type(scaler) is torch.amp.GradScaler:
        scaler = _sharded_copy(scaler, device)
    return FSDPPrecision(precision.precision, device=device, scaler=scaler)  # type: ignore[arg-type]


def _sharded_copy(scaler: torch.amp.GradScaler, device: str) -> torch.amp.GradScaler:
    """A ShardedGradScaler with the given scaler's settings and state: a user's GradScaler(init_scale=...,
    growth_interval=...) must not silently turn into a default one."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    sharded = ShardedGradScaler(device=device, enabled=scaler.is_enabled())
    settings = scaler.state_dict()  # empty for a disabled scaler
    if settings:
        sharded.load_state_dict(settings)
    return sharded


def _standard_plugin(precision: str, device: str, scaler: torch.amp.GradScaler | None) -> Precision:
    from fabric.precision.amp import MixedPrecision
    from fabric.precision.double import DoublePrecision
    from fabric.precision.half import HalfPrecision

    if precision in _MIXED_DTYPES:
        if scaler is None and precision == "16-mixed" and device == "cuda":
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            scaler = ShardedGradScaler()
        return MixedPrecision(precision, device=device, scaler=scaler)  # type: ignore[arg-type]
    if precision in ("16-true", "bf16-true"):
        return HalfPrecision(precision)  # type: ignore[arg-type]
    return DoublePrecision() if precision == "64-true" else Precision()
