"""What `fabric.setup` returns: thin wrappers that route forward and step through strategy and precision."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module
from torch.optim import Optimizer

from fabric import _forward_methods
from fabric._dataloader import _FabricDataLoader
from fabric._forward_methods import _ForwardGuard
from fabric.precision.precision import Precision
from fabric.utilities.device_dtype_mixin import _DeviceDtypeModuleMixin

if TYPE_CHECKING:
    # Only a type here: importing it at runtime would close the circle wrappers -> strategies -> checkpoint.
    from fabric.strategies.strategy import Strategy


class _BackwardState:
    """Per-Fabric flag telling output hooks whether backward runs through `fabric.backward`."""

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = False


class _FabricModule(_DeviceDtypeModuleMixin):
    """Runs forward under the precision policy; attributes and state dict come from the user's module."""

    def __init__(
        self,
        forward_module: Module,
        original_module: Module,
        precision: Precision,
        backward_state: _BackwardState | None = None,
        forward_guard: _ForwardGuard | None = None,
    ) -> None:
        super().__init__()
        self._forward_module = forward_module
        # Registered above as a submodule; also kept in __dict__ so the hot path skips Module.__getattr__.
        object.__setattr__(self, "_forward_call", forward_module)
        self._original_module = original_module
        self._precision = precision
        # Only hooked when a plain loss.backward() would silently be wrong; otherwise zero cost.
        self._backward_state = backward_state
        # Set only when calling the original module directly would bypass a multi-process strategy (see _mistakes).
        self._forward_guard = forward_guard
        # Methods routed through the wrapped forward (see fabric/_forward_methods.py), and those checked once.
        self._forward_methods = _forward_methods.default_forward_methods(original_module)
        self._checked_methods: set[str] = set()
        self._plain_forward = not precision.changes_forward and backward_state is None and forward_guard is None
        # Only the guard to lift (DDP and friends, 32-true): the common multi-process forward.
        self._guarded_forward = not precision.changes_forward and backward_state is None and forward_guard is not None
        self._route_call()
        self._fabric_module_initialized = True

    @property
    def module(self) -> Module:
        """The user's module, as Lightning Fabric exposes it."""
        return self._original_module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # torch's Module.__call__ is two frames and eight hook-table checks before forward, and even checking those
        # tables here cost about 4 us in a tiny training step (the kernels in between evict the interpreter's
        # working set). So what a call runs is decided when it can change (_route_call), not per call.
        direct = self._fabric_call
        if direct is not None:
            return direct(*args, **kwargs)
        guard = self._fabric_guard
        if guard is None:
            return Module.__call__(self, *args, **kwargs)
        # The common multi-process forward: the strategy's module with the guard lifted, which is `guard.call`
        # inlined: one Python frame instead of four (partial's target, call, lift, drop). A DDP step of a small
        # model evicts the interpreter's working set, so each frame costs about a microsecond: paired with the
        # four-frame call in one process, this saved 1.6 to 4.9 us of CPU per tiny DDP step in three runs.
        # benchmarks/ddp_layer.py shows what the guard still costs (about 4 us).
        guard.depth += 1
        if guard.depth == 1 and guard.hooks is not None:
            guard.hook = guard.hooks.pop(guard.key, None)
        try:
            return self._forward_call(*args, **kwargs)
        finally:
            guard.depth -= 1
            if guard.depth == 0 and guard.hook is not None and guard.hooks is not None:
                guard.hooks[guard.key] = guard.hook

    def _route_call(self) -> None:
        """Decide what `__call__` runs: the strategy's module at once (a plain forward), that call with the guard
        lifted (the common multi-process forward), or torch's Module.__call__ (hooks on this wrapper, a compiled
        call, or a precision policy to apply). Run at setup and whenever a hook or compile is added.

        A wrapper that once had a hook keeps torch's call after the hook is removed: correct, a little slower.
        Global module hooks run on the user's module and its children, as without fabric.
        """
        call: Callable[..., Any] | None = None  # the strategy's module, called as it is
        guard: _ForwardGuard | None = None  # that call with this guard lifted; both None: torch's call
        hooked = self._forward_hooks or self._forward_pre_hooks or self._backward_hooks or self._backward_pre_hooks
        if not hooked and self._compiled_call_impl is None:
            if self._plain_forward:
                call = self._forward_call
            elif self._guarded_forward:
                guard = self._forward_guard
        # In __dict__ without Module.__setattr__: the strategy's module must not become a submodule a second time.
        object.__setattr__(self, "_fabric_call", call)
        object.__setattr__(self, "_fabric_guard", guard)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Convert inputs, run forward under autocast/dtype policy, convert outputs."""
        if self._plain_forward:  # nothing to convert, guard or hook: the strategy's module, as raw torch calls it
            return self._forward_call(*args, **kwargs)
        guard = self._forward_guard
        if self._guarded_forward and guard is not None:  # the strategy's module with the guard lifted, nothing else
            return guard.call(self._forward_call, *args, **kwargs)
        if guard is not None:  # tells the original module's hook that this call comes through the strategy
            guard.lift()
        try:
            precision = self._precision
            if not precision.changes_forward:
                output = self._forward_call(*args, **kwargs)
            else:
                args, kwargs = precision.convert_input((args, kwargs))
                with precision.forward_context():
                    output = self._forward_call(*args, **kwargs)
                output = precision.convert_output(output)
        finally:
            if guard is not None:
                guard.drop()
        if self._backward_state is not None:
            _hook_outputs(output, self._backward_state)
        return output

    def mark_forward_method(self, method: str | Callable[..., Any]) -> None:
        """Run this method of your module through the strategy's wrapped forward, like forward itself."""
        name = method if isinstance(method, str) else method.__name__
        _forward_methods.check_markable(self._original_module, name)
        self._forward_methods.add(name)

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """The user's module's state dict, without wrapper prefixes."""
        return self._original_module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load into the user's module."""
        return self._original_module.load_state_dict(state_dict, strict=strict, assign=assign)

    def __getattr__(self, name: str) -> Any:
        # Module.__getattr__ only finds parameters, buffers and submodules; everything else is the user's.
        if name in ("_forward_module", "_original_module") or "_fabric_module_initialized" not in self.__dict__:
            return super().__getattr__(name)
        original: Module = self.__dict__["_modules"]["_original_module"]
        attribute = getattr(original, name)
        if not callable(attribute) or name.startswith("_"):
            return attribute
        if name in self.__dict__["_forward_methods"]:
            return partial(_forward_methods.call_through_forward, self.forward, original, name)
        checked = self.__dict__["_checked_methods"]
        wrapped = self.__dict__["_forward_call"] is not original
        if wrapped and name not in checked and getattr(attribute, "__self__", None) is original:
            return _forward_methods.tracked(original, name, attribute, checked, self.__dict__["_forward_guard"])
        return attribute

    def __setattr__(self, name: str, value: Any) -> None:
        # The wrapper's own attributes and properties (device, dtype) stay its own; everything else is the user's.
        # Module.compile() sets _compiled_call_impl (a class attribute until then) on the module it is called on.
        own = name in self.__dict__ or name == "_compiled_call_impl"
        if (
            own
            or isinstance(getattr(type(self), name, None), property)
            or "_fabric_module_initialized" not in self.__dict__
        ):
            super().__setattr__(name, value)
            if name == "_compiled_call_impl":  # calls must now go through torch's call, which runs it
                self._route_call()
            return
        setattr(self._original_module, name, value)


def _rerouting(name: str) -> Callable[..., Any]:
    """Module's hook registration `name`, which then re-decides what the wrapper's call runs."""
    register = getattr(Module, name)

    def method(self: _FabricModule, *args: Any, **kwargs: Any) -> Any:
        handle = register(self, *args, **kwargs)
        self._route_call()
        return handle

    method.__name__ = method.__qualname__ = name
    method.__doc__ = register.__doc__
    return method


for _name in (
    "register_forward_pre_hook",
    "register_forward_hook",
    "register_backward_hook",
    "register_full_backward_pre_hook",
    "register_full_backward_hook",
):
    setattr(_FabricModule, _name, _rerouting(_name))


def _hook_outputs(output: Any, state: _BackwardState) -> None:
    from fabric.utilities.apply_func import apply_to_collection

    def hook(tensor: Tensor) -> Tensor:
        if tensor.requires_grad:
            tensor.register_hook(lambda grad: _check_in_fabric_backward(grad, state))
        return tensor

    apply_to_collection(output, Tensor, hook)


def _check_in_fabric_backward(grad: Tensor, state: _BackwardState) -> Tensor:
    if not state.active:
        raise RuntimeError(
            "loss.backward(): this precision/strategy must see the backward pass (for example to scale a float16 "
            "loss), so a plain loss.backward() would give wrong gradients. Call fabric.backward(loss) instead."
        )
    return grad


_NOT_COPIED = frozenset({"step", "zero_grad", "state_dict", "param_groups", "state", "defaults"})


class _FabricOptimizer:
    """Shares the user's optimizer's state; `step` goes through the strategy and precision."""

    def __init__(self, optimizer: Optimizer, strategy: Strategy, callbacks: list[Any] | None = None) -> None:
        # A dynamic subclass of the user's optimizer class over a shallow copy of its __dict__: isinstance
        # checks, LR schedulers and attribute access (the same param_groups and state objects) behave as on
        # the original, at no cost. A copy, not the same dict: an LR scheduler patches `step` on the instance,
        # and sharing that patch with the original would make our step call itself.
        # param_groups, state and defaults are forwarding properties instead, because the original's
        # load_state_dict rebinds them and a copy would go stale.
        self.__dict__ = {k: v for k, v in optimizer.__dict__.items() if k not in _NOT_COPIED}
        self.__class__ = type("Fabric" + type(optimizer).__name__, (self.__class__, type(optimizer)), {})
        self._fabric_optimizer = optimizer
        self._fabric_strategy = strategy
        # Neither the strategy nor its precision adds anything to a step: call the optimizer's own (every step).
        self._fabric_plain_step = strategy._runs_base("optimizer_step")
        # The Fabric's own list (not a copy): a LightningModule set up later is called too, as in Lightning.
        self._fabric_callbacks = callbacks if callbacks is not None else []
        # The user's own zero_grad, bound here: nothing goes through the strategy, and in a step of a small model
        # each extra Python frame costs 1-2 us (the kernels in between evict the interpreter's working set).
        self.zero_grad = optimizer.zero_grad  # type: ignore[method-assign]

    @property
    def optimizer(self) -> Optimizer:
        """The user's optimizer."""
        return self._fabric_optimizer

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The user's optimizer's parameter groups (the same list)."""
        return self._fabric_optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self._fabric_optimizer.param_groups = value

    @property
    def state(self) -> Any:
        """The user's optimizer's per-parameter state (the same dict)."""
        return self._fabric_optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self._fabric_optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        """The user's optimizer's defaults."""
        return self._fabric_optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self._fabric_optimizer.defaults = value

    def step(self, closure: Any = None) -> Any:
        """Step through the strategy (and so the precision plugin's scaler, if any)."""
        if self._fabric_plain_step:
            output = self._fabric_optimizer.step() if closure is None else self._fabric_optimizer.step(closure)
        elif closure is None:
            output = self._fabric_strategy.optimizer_step(self._fabric_optimizer)
        else:
            output = self._fabric_strategy.optimizer_step(self._fabric_optimizer, closure=closure)
        if self._fabric_callbacks:
            from fabric._hooks import call_hook

            hook_kwargs = {"strategy": self._fabric_strategy, "optimizer": self._fabric_optimizer}
            call_hook(self._fabric_callbacks, "on_after_optimizer_step", (), hook_kwargs)
        return output

    def zero_grad(self, *args: Any, **kwargs: Any) -> Any:
        """The user's optimizer's zero_grad (run there, it reads its own attributes, not this wrapper's properties)."""
        return self._fabric_optimizer.zero_grad(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer state as the strategy assembles it."""
        return self._fabric_strategy.get_optimizer_state(self._fabric_optimizer)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load into the user's optimizer."""
        self._fabric_optimizer.load_state_dict(state_dict)


def _uncompiled(module: Module) -> Module:
    """The module inside a torch.compile wrapper (recognised by name: torch._dynamo is costly to import).

    A compiled model keeps running compiled, but attributes and state_dict come from the module inside it, so its
    keys carry no "_orig_mod." prefix, as in Lightning Fabric (where _reapply_compile=False keeps the wrapper).
    """
    inner = getattr(module, "_orig_mod", None)
    return inner if type(module).__name__ == "OptimizedModule" and isinstance(inner, Module) else module


def _module_dtype(module: Module) -> Any:
    """What `.dtype` reports for a set-up module: its own (LightningModule) or that of its floating-point weights."""
    own = getattr(type(module), "dtype", None)
    if isinstance(own, property):
        return module.dtype
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_floating_point():
            return tensor.dtype
    return torch.get_default_dtype()


def is_wrapped(obj: object) -> bool:
    """Whether `obj` was returned by `fabric.setup*` (`setup_dataloaders` included)."""
    return isinstance(obj, (_FabricModule, _FabricOptimizer, _FabricDataLoader))


def unwrap_objects(obj: Any) -> Any:
    """The user's own module or optimizer behind a fabric wrapper (and behind torch.compile)."""
    if isinstance(obj, _FabricModule):
        obj = obj._original_module
    elif isinstance(obj, _FabricOptimizer):
        obj = obj._fabric_optimizer
    compiled = getattr(obj, "_orig_mod", None)
    return compiled if isinstance(compiled, Module) else obj


def _unwrap_objects(collection: Any) -> Any:
    """Lightning's form: every wrapper anywhere in a (nested) collection replaced by the object it wraps."""
    from fabric.utilities.apply_func import apply_to_collection

    def unwrap(obj: Any) -> Any:
        return obj._dataloader if isinstance(obj, _FabricDataLoader) else unwrap_objects(obj)

    return apply_to_collection(collection, (_FabricModule, _FabricOptimizer, _FabricDataLoader, Module), unwrap)


__all__ = ["_FabricDataLoader", "_FabricModule", "_FabricOptimizer", "_unwrap_objects", "is_wrapped", "unwrap_objects"]
