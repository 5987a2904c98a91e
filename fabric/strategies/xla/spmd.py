"""`xla_spmd`: one process drives every XLA device of the host as one SPMD mesh (torch_xla.distributed.spmd).

Parameters are sharded FSDPv2-style along the mesh's "fsdp" axis, a sharding plan splits named weights along any
axis (tensor parallelism), and batches are split along the "data"/"fsdp" axes. The XLA compiler inserts every
collective, so the script sees one process, one device and whole (logical) tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from torch.nn import Module

from fabric.accelerators.accelerator import Accelerator
from fabric.io.checkpoint_io import CheckpointIO
from fabric.precision.precision import Precision
from fabric.strategies._one_process import OneProcessStrategy
from fabric.strategies.xla import spmd_mesh
from fabric.strategies.xla._common import ParameterMoves, check_components, explain_early_backward
from fabric.utilities.exceptions import FabricTypeError, FabricValueError

if TYPE_CHECKING:
    from torch.optim import Optimizer
    from torch.utils.data import DataLoader
    from torch_xla.distributed.spmd import Mesh

_STATE_DICT_TYPES = ("sharded", "full")


class XLASPMDStrategy(OneProcessStrategy):
    """All XLA devices of this host as one mesh, driven by this one process (torch_xla SPMD, FSDPv2).

    Args:
        mesh_shape: devices per mesh axis, their product the host's device count (one entry may be -1: the rest).
            Default: every device on the first axis.
        axis_names: one name per axis, from "data", "fsdp", "model". Default by the number of axes: ("fsdp",),
            ("fsdp", "model"), ("data", "fsdp", "model").
        sharding_plan: {parameter-name pattern (fnmatch): partition spec}, e.g. {"*.q.weight": ("model", None)};
            each spec entry is a mesh axis, a tuple of axes, or None, one per dimension of the parameter.
        auto_wrap_policy: torch_xla's FSDPv2 auto-wrap policy (shard layer by layer); None: the whole model.
        shard_output: torch_xla's FSDPv2 `shard_output(output, mesh)`, for forwards that return no tensor first.
        state_dict_type: "sharded" (a torch.distributed.checkpoint directory) or "full" (one file of CPU tensors).
    """

    drives_xla = True

    def __init__(
        self,
        mesh_shape: tuple[int, ...] | None = None,
        axis_names: tuple[str, ...] | None = None,
        sharding_plan: Mapping[str, tuple[Any, ...]] | None = None,
        auto_wrap_policy: Callable[..., bool] | None = None,
        shard_output: Callable[[Any, Any], None] | None = None,
        state_dict_type: str = "sharded",
        accelerator: Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision: Precision | None = None,
    ) -> None:
        super().__init__(accelerator=accelerator, checkpoint_io=checkpoint_io, precision=precision)
        name = type(self).__name__
        self._mesh_argument = spmd_mesh.check_shape(mesh_shape, name)
        self.axis_names = spmd_mesh.axis_names_for(self._mesh_argument, axis_names, name)
        self._plan = spmd_mesh.check_plan(sharding_plan, self.axis_names, name)
        if state_dict_type not in _STATE_DICT_TYPES:
            raise FabricValueError(
                f"{name}(state_dict_type={state_dict_type!r}): unknown checkpoint layout. Use 'sharded' (a "
                "torch.distributed.checkpoint directory) or 'full' (one file)."
            )
        self._state_dict_type = state_dict_type
        self._auto_wrap_policy = auto_wrap_policy
        self._shard_output = shard_output
        self.mesh_shape: tuple[int, ...] | None = None
        self._mesh: Mesh | None = None
        self._moves = ParameterMoves()

    def _connect(self, *, parallel_devices: list[torch.device], num_nodes: int, **components: Any) -> None:
        """The XLA accelerator, one machine, every one of its devices: then the mesh's sizes are known."""
        _require_torch_xla()
        super()._connect(parallel_devices=parallel_devices, num_nodes=num_nodes, **components)
        name = type(self).__name__
        accelerator = self.accelerator
        if parallel_devices[0].type != "xla" or accelerator is None:
            raise FabricValueError(
                f"Fabric(strategy='xla_spmd', accelerator={type(accelerator).__name__}): xla_spmd runs on XLA "
                "devices only. Pass accelerator='tpu' (or 'xla'; for tests on the CPU set PJRT_DEVICE=CPU and "
                "CPU_NUM_DEVICES=4)."
            )
        if num_nodes != 1:
            raise FabricValueError(
                f"Fabric(strategy='xla_spmd', num_nodes={num_nodes}): this strategy drives the devices of one host "
                "from one process; meshes across hosts are not supported. Use num_nodes=1, or strategy='xla' "
                "(one process per device) on several hosts."
            )
        check_components("xla_spmd", None, self._precision)
        available = accelerator.auto_device_count()
        if len(parallel_devices) != available:
            raise FabricValueError(
                f"Fabric(strategy='xla_spmd', devices={len(parallel_devices)}): xla_spmd shards over every device "
                f"of this host, which has {available}. Use devices='auto' (or {available}), and mesh_shape to "
                "choose how they are split."
            )
        self.mesh_shape = spmd_mesh.resolve_shape(self._mesh_argument, self.axis_names, available, name)

    def _precision_plugin(self, name: str, device_type: str) -> Precision | None:
        """XLAPrecision for every precision given by name: its optimizer step also ends the lazy graph, so each
        training step compiles once and runs as one program."""
        from fabric.precision.xla import XLAPrecision

        return XLAPrecision(name)

    @property
    def root_device(self) -> torch.device:
        """The one virtual device of SPMD mode: a tensor on it is laid out over the whole mesh."""
        return torch.device("xla", 0)

    @property
    def mesh(self) -> Mesh:
        """The torch_xla mesh (for `xs.mark_sharding` of your own activations); exists once launched."""
        if self._mesh is None:
            raise RuntimeError(
                "XLASPMDStrategy.mesh: the mesh is built when the process is set up. Call fabric.launch() (or "
                "fabric.setup) first."
            )
        return self._mesh

    @property
    def state_dict_type(self) -> str:
        """'sharded' or 'full': the layout fabric.save writes."""
        return self._state_dict_type

    def backward(self, tensor: Tensor, module: Module | None, *args: Any, **kwargs: Any) -> None:
        """Backward through the precision plugin; an autograd engine sized before XLA started is explained."""
        with explain_early_backward():
            super().backward(tensor, module, *args, **kwargs)

    def setup_environment(self) -> None:
        """Switch torch_xla to SPMD mode before any XLA tensor exists, then build the mesh."""
        _require_torch_xla()
        import torch_xla.runtime as xr

        if self._mesh is not None:
            return
        xr.use_spmd()
        assert self.mesh_shape is not None, "_connect resolves the mesh shape"
        count = xr.global_runtime_device_count()
        spmd_mesh.resolve_shape(self.mesh_shape, self.axis_names, count, type(self).__name__)
        self._mesh = spmd_mesh.build_mesh(self.mesh_shape, self.axis_names)

    def module_to_device(self, module: Module) -> None:
        """Move the module to the mesh's device, remembering which new parameters replaced the CPU ones."""
        self._moves.move(module, self.root_device)

    def setup_optimizer(self, optimizer: Optimizer) -> Optimizer:
        """Point an optimizer created before the move at the parameters on the device."""
        self._moves.update(optimizer)
        return optimizer

    def setup_module(self, module: Module) -> Module:
        """Shard the parameters the plan names, then the rest FSDPv2-style if the mesh has an 'fsdp' axis."""
        import torch_xla.distributed.spmd as xs

        self.module_to_device(module)  # already there unless setup(move_to_device=False)
        specs = spmd_mesh.match_plan(self._plan, module.named_parameters(), type(self).__name__)
        params = dict(module.named_parameters())
        for name, spec in specs.items():
            xs.mark_sharding(params[name], self.mesh, spec)
        if "fsdp" not in self.axis_names:
            return module  # parameters outside the plan stay whole on every device (data parallel)
        from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

        return SpmdFullyShardedDataParallel(
            module,
            mesh=self.mesh,
            shard_output=self._shard_output,
            auto_wrap_policy=self._auto_wrap_policy,
            extra_data_axis="data" if "data" in self.axis_names else None,
        )

    def process_dataloader(self, dataloader: DataLoader, *, even_batches: bool = True) -> Any:
        """This process reads every batch (every sample once, whatever even_batches says); each batch is split
        over the mesh's data axes as it reaches the device."""
        from fabric.strategies.xla.spmd_data import SpmdDataLoader

        return SpmdDataLoader(dataloader, self.mesh, self.root_device)

    def all_reduce(self, tensor: Tensor, group: Any | None = None, reduce_op: str = "mean") -> Tensor:
        """One process holding whole (logical) tensors: the tensor itself, the same on every device."""
        from fabric.utilities.distributed import check_reduce_op

        check_reduce_op(reduce_op)
        return tensor

    def barrier(self, name: str | None = None) -> None:
        """Nobody to wait for; the XLA work queued so far runs to completion first."""
        _run_pending()

    # -- checkpoints --------------------------------------------------------------------------------
    def save_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any],
        storage_options: Any = None,
        filter: dict[str, Callable[[str, Any], bool]] | None = None,
    ) -> None:
        """A DCP directory with each device's shard ('sharded'), or one file of whole CPU tensors ('full')."""
        from fabric.checkpoint import sharded as _sharded_checkpoint
        from fabric.checkpoint import state as _state
        from fabric.strategies.xla import spmd_checkpoint

        if storage_options is not None:
            raise FabricTypeError(
                "XLASPMDStrategy.save_checkpoint(storage_options=...): checkpoints of xla_spmd take no storage "
                "options. Drop storage_options."
            )
        sharded = self._state_dict_type == "sharded"
        if sharded and self.checkpoint_io.asynchronous:
            raise FabricValueError(
                f"XLASPMDStrategy.save_checkpoint({str(path)!r}) with {type(self.checkpoint_io).__name__}: sharded "
                "xla_spmd checkpoints are written synchronously. Drop the asynchronous CheckpointIO, or use "
                "XLASPMDStrategy(state_dict_type='full')."
            )
        _run_pending()  # checkpoints read the tensors' device data, which must not be waiting on queued work
        if sharded:
            planner = spmd_checkpoint.save_planner()
            _sharded_checkpoint.save_sharded(path, state, filter, 1, 0, self.barrier, planner=planner)
            return
        converted = _state.convert_state(state, self.get_module_state_dict, self.get_optimizer_state, filter)
        self.checkpoint_io.save_checkpoint(spmd_checkpoint.to_cpu(converted), path)

    def load_checkpoint(
        self,
        path: str | Path,
        state: dict[str, Any] | Module | Optimizer | None = None,
        strict: bool = True,
        weights_only: bool | None = None,
    ) -> dict[str, Any]:
        """A DCP directory (from xla_spmd, FSDP or model-parallel runs) is read shard by shard into the XLA
        tensors in place; a full file as on any strategy."""
        from fabric.checkpoint import sharded as _sharded_checkpoint
        from fabric.strategies.xla import spmd_checkpoint

        _run_pending()
        if _sharded_checkpoint.is_sharded_checkpoint(path):
            return _sharded_checkpoint.load(path, state, strict, weights_only, planner=spmd_checkpoint.load_planner)
        return super().load_checkpoint(path, state, strict, weights_only)


def _require_torch_xla() -> None:
    from fabric.accelerators.xla import xla_installed

    if not xla_installed():
        raise ModuleNotFoundError(
            "Fabric(strategy='xla_spmd'): torch_xla is not installed. Install it with `pip install "
            "'torchfabric[xla]'` (on a TPU VM: `pip install 'torch_xla[tpu]'`)."
        )


def _run_pending() -> None:
    import torch_xla
    import torch_xla.core.xla_model as xm

    torch_xla.sync()
    xm.wait_device_ops()
