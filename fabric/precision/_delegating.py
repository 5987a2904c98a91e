"""A precision whose numeric policy is one of the standard plugins, with a strategy's own step or sharding on top."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from torch.nn import Module

from fabric.precision.precision import Precision


class _DelegatingPrecision(Precision):
    """Casting, init contexts, autocast and input/output conversion come from `self._policy`, which the
    subclass's constructor sets (HalfPrecision, MixedPrecision, ...); the subclass adds what its strategy needs."""

    _policy: Precision

    def convert_module(self, module: Module) -> Module:
        """The policy's cast (the `-true` policies cast the parameters)."""
        return self._policy.convert_module(module)

    def tensor_init_context(self) -> AbstractContextManager:
        """New tensors take the policy's dtype."""
        return self._policy.tensor_init_context()

    def module_init_context(self) -> AbstractContextManager:
        """New modules take the policy's dtype."""
        return self._policy.module_init_context()

    def forward_context(self) -> AbstractContextManager:
        """The policy's autocast (`*-mixed`) or default dtype (`*-true`)."""
        return self._policy.forward_context()

    def convert_input(self, data: Any) -> Any:
        """Floating inputs in the compute dtype."""
        return self._policy.convert_input(data)

    def convert_output(self, data: Any) -> Any:
        """Floating outputs back in the default dtype."""
        return self._policy.convert_output(data)
