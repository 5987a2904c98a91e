"""Quantised linear layers with bitsandbytes: 4-bit (nf4, fp4) or 8-bit (int8) weights, a 16-bit compute dtype.

bitsandbytes is imported when a BitsandbytesPrecision is created, never by `import fabric`.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any, Literal

import torch
from torch import nn

from fabric.precision.precision import Precision, _convert_floating, _DefaultDtype
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

_MODES = ("nf4", "nf4-dq", "fp4", "fp4-dq", "int8", "int8-training")


class BitsandbytesPrecision(Precision):
    """Replaces the model's `nn.Linear` layers by bitsandbytes' quantised ones in `fabric.setup`.

    Modes (Lightning's): "nf4" / "fp4" store 4-bit weights ("-dq" also quantises the quantisation constants),
    "int8" stores 8-bit weights for inference, "int8-training" keeps 16-bit weights that train and computes
    the matrix products in 8 bits. Quantised 4-bit and "int8" weights are frozen; biases and every other layer
    train. The weights are quantised when the model moves to its device (fabric.setup does it). Layers whose
    qualified name starts with one of `ignore_modules` (e.g. {"lm_head"}) are left in `dtype`.
    The optimizer is not replaced: pass a bitsandbytes 8-bit optimizer yourself if you want one.
    """

    changes_forward = True

    def __init__(
        self,
        mode: Literal["nf4", "nf4-dq", "fp4", "fp4-dq", "int8", "int8-training"],
        dtype: torch.dtype | None = None,
        ignore_modules: set[str] | None = None,
    ) -> None:
        if mode not in _MODES:
            raise FabricValueError(
                f"BitsandbytesPrecision(mode={mode!r}): unknown quantisation mode. Use one of {', '.join(_MODES)}."
            )
        if dtype is None:
            bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
            dtype = torch.bfloat16 if bf16 and not mode.startswith("int8") else torch.float16
        if mode.startswith("int8") and dtype is not torch.float16:
            # bitsandbytes' 8-bit matmul casts its inputs to float16 (as in Lightning, which has the same rule).
            raise FabricValueError(
                f"BitsandbytesPrecision(mode={mode!r}, dtype={dtype}): 8-bit layers compute in float16. "
                "Pass dtype=torch.float16 or leave dtype unset."
            )
        self._bnb = _import_bitsandbytes()
        self.mode = mode
        self.dtype = dtype
        self.ignore_modules = set(ignore_modules or ())
        self.precision = f"bitsandbytes-{mode}"

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Cast to `dtype`, then swap each `nn.Linear` (outside `ignore_modules`) for its quantised counterpart."""
        if not any(isinstance(m, nn.Linear) for m in module.modules()):
            raise FabricTypeError(
                f"BitsandbytesPrecision(mode={self.mode!r}) with {type(module).__name__}: the model has no "
                "nn.Linear layers, so nothing would be quantised. Use another precision for this model."
            )
        module.to(dtype=self.dtype)
        _replace_linears(module, self._quantised_layer, self.ignore_modules, "")
        return module

    def _quantised_layer(self, linear: nn.Linear) -> nn.Module:
        bnb = self._bnb
        has_bias = linear.bias is not None
        weight = linear.weight.data
        if self.mode.startswith("int8"):
            trains = self.mode == "int8-training"
            layer = bnb.nn.Linear8bitLt(
                linear.in_features, linear.out_features, bias=has_bias, has_fp16_weights=trains, device="meta"
            )
            layer.weight = bnb.nn.Int8Params(weight, requires_grad=trains, has_fp16_weights=trains)
        else:
            quant_type, double = self.mode[:3], self.mode.endswith("-dq")
            layer = bnb.nn.Linear4bit(
                linear.in_features,
                linear.out_features,
                bias=has_bias,
                compute_dtype=self.dtype,
                compress_statistics=double,
                quant_type=quant_type,
                device="meta",
            )
            layer.weight = bnb.nn.Params4bit(
                weight, requires_grad=False, quant_type=quant_type, compress_statistics=double
            )
        if has_bias:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=linear.bias.requires_grad)
        return layer

    def tensor_init_context(self) -> AbstractContextManager:
        """New tensors (and modules under init_module) default to the compute dtype."""
        return _DefaultDtype(self.dtype)

    def forward_context(self) -> AbstractContextManager:
        """Tensors created during forward default to the compute dtype."""
        return _DefaultDtype(self.dtype)

    def convert_input(self, data: Any) -> Any:
        """Float inputs in the compute dtype."""
        return _convert_floating(data, self.dtype)

    def convert_output(self, data: Any) -> Any:
        """Outputs in the default dtype, for the loss and metrics."""
        return _convert_floating(data, torch.get_default_dtype())


def _replace_linears(module: nn.Module, make: Callable[[nn.Linear], nn.Module], ignore: set[str], prefix: str) -> None:
    for name, child in module.named_children():
        qualified = f"{prefix}.{name}" if prefix else name
        if any(qualified.startswith(ignored) for ignored in ignore):
            continue  # a prefix, as in Lightning: "transformer.blocks" skips every layer inside the blocks
        if isinstance(child, nn.Linear):
            setattr(module, name, make(child))
        else:
            _replace_linears(child, make, ignore, qualified)


def _import_bitsandbytes() -> ModuleType:
    try:
        import bitsandbytes
    except ImportError as err:
        raise ModuleNotFoundError(
            f"BitsandbytesPrecision: bitsandbytes cannot be imported ({err}). Install it: pip install bitsandbytes."
        ) from None
    return bitsandbytes
