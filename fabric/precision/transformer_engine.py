"""float8 training with NVIDIA Transformer Engine (CUDA only); transformer_engine is imported only when used."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from contextlib import AbstractContextManager, ExitStack
from typing import Any

import torch
from torch import nn

from fabric.precision.precision import Precision, _convert_floating, _DefaultDtype


class TransformerEnginePrecision(Precision):
    """Linear and LayerNorm layers run in float8 under Transformer Engine's `fp8_autocast`.

    `weights_dtype` is the dtype of the parameters (bfloat16 or float16); `recipe` is a `DelayedScaling` or a dict
    of its arguments (`fp8_format` may be a name such as "HYBRID"); `replace_layers` (default True) swaps
    `nn.Linear` / `nn.LayerNorm` for `te.Linear` / `te.LayerNorm` in `fabric.setup`; operations float8 cannot
    run use `torch.autocast` to `fallback_compute_dtype` (default: `weights_dtype`).
    """

    changes_forward = True

    def __init__(
        self,
        *,
        weights_dtype: torch.dtype,
        recipe: Mapping[str, Any] | Any | None = None,
        replace_layers: bool | None = None,
        fallback_compute_dtype: torch.dtype | None = None,
    ) -> None:
        _check_available()
        from transformer_engine.common.recipe import DelayedScaling, Format

        if recipe is None:
            recipe = DelayedScaling()
        elif isinstance(recipe, Mapping):
            arguments = dict(recipe)
            if isinstance(arguments.get("fp8_format"), str):
                arguments["fp8_format"] = getattr(Format, arguments["fp8_format"])
            recipe = DelayedScaling(**arguments)
        self.weights_dtype = weights_dtype
        self.recipe = recipe
        self.replace_layers = replace_layers
        self.fallback_compute_dtype = fallback_compute_dtype or weights_dtype
        self.precision = "transformer-engine-float16" if weights_dtype == torch.float16 else "transformer-engine"

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Swap the layers (unless the model already has Transformer Engine layers), then cast to weights_dtype."""
        has_te_layers = any(type(m).__module__.startswith("transformer_engine") for m in module.modules())
        if self.replace_layers is not False and not has_te_layers:
            _replace_layers(module, "")
        return module.to(dtype=self.weights_dtype)

    def tensor_init_context(self) -> AbstractContextManager:
        """New tensors default to weights_dtype."""
        return _DefaultDtype(self.weights_dtype)

    def forward_context(self) -> AbstractContextManager:
        """float8 for the Transformer Engine layers inside a 16-bit autocast for everything else."""
        import transformer_engine.pytorch as te

        stack = ExitStack()
        stack.enter_context(_DefaultDtype(self.weights_dtype))
        stack.enter_context(torch.autocast("cuda", dtype=self.fallback_compute_dtype))
        stack.enter_context(te.fp8_autocast(enabled=True, fp8_recipe=self.recipe))
        return stack

    def convert_input(self, data: Any) -> Any:
        """Float inputs in weights_dtype."""
        return _convert_floating(data, self.weights_dtype)

    def convert_output(self, data: Any) -> Any:
        """Outputs in the default dtype."""
        return _convert_floating(data, torch.get_default_dtype())


def _check_available() -> None:
    """float8 kernels exist only in Transformer Engine, on CUDA GPUs; name what is missing here."""
    import importlib.util

    missing = []
    if importlib.util.find_spec("transformer_engine") is None:
        missing.append("the transformer_engine package (pip install transformer-engine[pytorch])")
    if not torch.cuda.is_available():
        missing.append("a CUDA GPU")
    if missing:
        raise RuntimeError(
            f"TransformerEnginePrecision(): float8 training needs NVIDIA Transformer Engine on a CUDA GPU, and "
            f"this machine lacks {' and '.join(missing)}. Use precision='bf16-mixed' here."
        )


def _replace_layers(module: nn.Module, prefix: str) -> None:
    import transformer_engine.pytorch as te

    for name, child in module.named_children():
        qualified = f"{prefix}.{name}" if prefix else name
        if isinstance(child, nn.Linear):
            if child.in_features % 8 or child.out_features % 16:
                # Transformer Engine's float8 GEMMs need these multiples; the layer stays a 16-bit nn.Linear.
                warnings.warn(
                    f"TransformerEnginePrecision: layer {qualified!r} ({child.in_features} -> {child.out_features}) "
                    "is not replaced: float8 needs in_features divisible by 8 and out_features by 16. Pad it "
                    "to use float8 there.",
                    stacklevel=3,
                )
                continue
            replacement = te.Linear(child.in_features, child.out_features, bias=child.bias is not None)
            _copy_parameters(child, replacement)
            setattr(module, name, replacement)
        elif isinstance(child, nn.LayerNorm) and len(child.normalized_shape) == 1:
            replacement = te.LayerNorm(child.normalized_shape[0], eps=child.eps)
            _copy_parameters(child, replacement)
            setattr(module, name, replacement)
        else:
            _replace_layers(child, qualified)


def _copy_parameters(source: nn.Module, target: nn.Module) -> None:
    with torch.no_grad():
        for name in ("weight", "bias"):
            theirs, ours = getattr(source, name, None), getattr(target, name, None)
            if theirs is not None and ours is not None:
                ours.copy_(theirs)
