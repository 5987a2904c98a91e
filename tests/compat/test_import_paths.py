"""Every public import path of Lightning Fabric 2.6's API reference exists under `fabric.`, after the `sed` rename.

The list is written out here (not read from an installed Lightning) so that the test needs no Lightning and
says exactly what users can import.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pytest

import fabric

REPO = Path(__file__).resolve().parents[2]

SUPPORTED: list[tuple[str, str]] = [
    # top level: `from lightning.fabric import ...`
    ("fabric", "Fabric"),
    ("fabric", "seed_everything"),
    ("fabric", "is_wrapped"),
    ("fabric.fabric", "Fabric"),
    # precision plugins and the dp strategy
    *(("fabric.plugins", n) for n in ("DeepSpeedPrecision", "FSDPPrecision", "BitsandbytesPrecision")),
    ("fabric.plugins", "TransformerEnginePrecision"),
    *(("fabric.plugins.precision", n) for n in ("DeepSpeedPrecision", "FSDPPrecision", "BitsandbytesPrecision")),
    ("fabric.plugins.precision", "TransformerEnginePrecision"),
    ("fabric.strategies", "DataParallelStrategy"),
    # Not a Lightning Fabric name (Lightning has it in lightning.pytorch only); offered on the same path.
    ("fabric.plugins.io", "AsyncCheckpointIO"),
    # accelerators
    *(("fabric.accelerators", n) for n in ("Accelerator", "CPUAccelerator", "CUDAAccelerator", "MPSAccelerator")),
    ("fabric.accelerators", "find_usable_cuda_devices"),
    ("fabric.accelerators", "ACCELERATOR_REGISTRY"),
    ("fabric.accelerators", "XLAAccelerator"),
    # strategies
    *(
        ("fabric.strategies", n)
        for n in (
            "Strategy",
            "ParallelStrategy",
            "SingleDeviceStrategy",
            "DDPStrategy",
            "DeepSpeedStrategy",
            "FSDPStrategy",
            "ModelParallelStrategy",
            "STRATEGY_REGISTRY",
        )
    ),
    # loggers
    *(("fabric.loggers", n) for n in ("Logger", "CSVLogger", "TensorBoardLogger")),
    # plugins, as Lightning groups them
    *(
        ("fabric.plugins", n)
        for n in (
            "ClusterEnvironment",
            "CheckpointIO",
            "TorchCheckpointIO",
            "Precision",
            "MixedPrecision",
            "HalfPrecision",
            "DoublePrecision",
        )
    ),
    *(("fabric.plugins.precision", n) for n in ("Precision", "MixedPrecision", "HalfPrecision", "DoublePrecision")),
    *(
        ("fabric.plugins.environments", n)
        for n in (
            "ClusterEnvironment",
            "KubeflowEnvironment",
            "LightningEnvironment",
            "LSFEnvironment",
            "MPIEnvironment",
            "SLURMEnvironment",
            "TorchElasticEnvironment",
        )
    ),
    *(("fabric.plugins.io", n) for n in ("CheckpointIO", "TorchCheckpointIO")),
    *(("fabric.plugins.collectives", n) for n in ("Collective", "TorchCollective", "SingleDeviceCollective")),
    # the modules behind those names, which code also imports directly
    ("fabric.plugins.precision.amp", "MixedPrecision"),
    ("fabric.plugins.precision.half", "HalfPrecision"),
    ("fabric.plugins.precision.double", "DoublePrecision"),
    ("fabric.plugins.precision.precision", "Precision"),
    ("fabric.plugins.environments.cluster_environment", "ClusterEnvironment"),
    ("fabric.plugins.environments.kubeflow", "KubeflowEnvironment"),
    ("fabric.plugins.environments.lightning", "LightningEnvironment"),
    ("fabric.plugins.environments.lsf", "LSFEnvironment"),
    ("fabric.plugins.environments.mpi", "MPIEnvironment"),
    ("fabric.plugins.environments.slurm", "SLURMEnvironment"),
    ("fabric.plugins.environments.torchelastic", "TorchElasticEnvironment"),
    ("fabric.plugins.io.checkpoint_io", "CheckpointIO"),
    ("fabric.plugins.io.torch_io", "TorchCheckpointIO"),
    ("fabric.plugins.collectives.collective", "Collective"),
    ("fabric.plugins.collectives.torch_collective", "TorchCollective"),
    ("fabric.plugins.collectives.single_device", "SingleDeviceCollective"),
    ("fabric.accelerators.accelerator", "Accelerator"),
    ("fabric.accelerators.cpu", "CPUAccelerator"),
    ("fabric.accelerators.cuda", "CUDAAccelerator"),
    ("fabric.accelerators.mps", "MPSAccelerator"),
    ("fabric.strategies.strategy", "Strategy"),
    ("fabric.strategies.parallel", "ParallelStrategy"),
    ("fabric.strategies.single_device", "SingleDeviceStrategy"),
    ("fabric.strategies.ddp", "DDPStrategy"),
    ("fabric.strategies.fsdp", "FSDPStrategy"),
    ("fabric.strategies.deepspeed", "DeepSpeedStrategy"),
    ("fabric.strategies.model_parallel", "ModelParallelStrategy"),
    ("fabric.loggers.logger", "Logger"),
    ("fabric.loggers.logger", "rank_zero_experiment"),
    ("fabric.loggers.csv_logs", "CSVLogger"),
    ("fabric.loggers.tensorboard", "TensorBoardLogger"),
    # wrappers
    *(("fabric.wrappers", n) for n in ("_FabricModule", "_FabricOptimizer", "_FabricDataLoader", "is_wrapped")),
    # utilities: what lightning.fabric.utilities exports, then the modules its API reference documents
    *(
        ("fabric.utilities", n)
        for n in (
            "AttributeDict",
            "LightningEnum",
            "Throughput",
            "ThroughputMonitor",
            "disable_possible_user_warnings",
            "is_shared_filesystem",
            "measure_flops",
            "move_data_to_device",
            "rank_zero_deprecation",
            "rank_zero_info",
            "rank_zero_only",
            "rank_zero_warn",
            "suggested_max_num_workers",
        )
    ),
    *(("fabric.utilities.seed", n) for n in ("seed_everything", "reset_seed", "pl_worker_init_function")),
    *(("fabric.utilities.data", n) for n in ("AttributeDict", "suggested_max_num_workers", "has_len", "sized_len")),
    ("fabric.utilities.data", "has_iterable_dataset"),
    ("fabric.utilities.data", "_set_sampler_epoch"),
    *(("fabric.utilities.distributed", n) for n in ("is_shared_filesystem",)),
    ("fabric.utilities.warnings", "disable_possible_user_warnings"),
    ("fabric.utilities.warnings", "PossibleUserWarning"),
    ("fabric.utilities.enums", "LightningEnum"),
    *(
        ("fabric.utilities.throughput", n)
        for n in ("Throughput", "ThroughputMonitor", "measure_flops", "get_available_flops")
    ),
    *(
        ("fabric.utilities.rank_zero", n)
        for n in (
            "rank_zero_only",
            "rank_zero_warn",
            "rank_zero_info",
            "rank_zero_debug",
            "rank_zero_deprecation",
            "rank_prefixed_message",
            "LightningDeprecationWarning",
            "WarningCache",
        )
    ),
    *(
        ("fabric.utilities.apply_func", n)
        for n in ("move_data_to_device", "apply_to_collection", "convert_to_tensors", "convert_tensors_to_scalars")
    ),
    ("fabric.utilities.exceptions", "MisconfigurationException"),
    ("fabric.utilities.cloud_io", "get_filesystem"),
    ("fabric.utilities.cloud_io", "_load"),
    *(
        ("fabric.utilities.load", n)
        for n in ("_lazy_load", "_materialize_tensors", "_load_distributed_checkpoint", "_NotYetLoadedTensor")
    ),
    *(
        ("fabric.utilities.imports", n)
        for n in (
            "_TORCH_GREATER_EQUAL_2_2",
            "_TORCH_GREATER_EQUAL_2_3",
            "_TORCH_GREATER_EQUAL_2_4",
            "_TORCH_GREATER_EQUAL_2_5",
            "_TORCH_GREATER_EQUAL_2_6",
            "_IS_WINDOWS",
            "_NUMPY_AVAILABLE",
        )
    ),
    *(
        ("fabric.utilities.init", n)
        for n in (
            "_EmptyInit",
            "_has_meta_device_parameters_or_buffers",
            "_materialize",
            "_materialize_meta_tensors",
            "_materialize_distributed_module",
        )
    ),
    ("fabric.utilities.optimizer", "_optimizer_to_device"),
    ("fabric.utilities.optimizer", "_optimizers_to_device"),
    ("fabric.utilities.distributed", "ReduceOp"),
    ("fabric.utilities.device_parser", "_parse_gpu_ids"),
    ("fabric.utilities.device_parser", "_determine_root_gpu_device"),
    *(
        ("fabric.utilities.types", n)
        for n in (
            "_PATH",
            "_DEVICE",
            "_MAP_LOCATION_TYPE",
            "_PARAMETERS",
            "_Stateful",
            "CollectibleGroup",
            "Steppable",
            "Optimizable",
            "ReduceOp",
            "RedOpType",
            "LRScheduler",
            "ReduceLROnPlateau",
        )
    ),
]

# The private and module paths published projects import (issue 19: litgpt, sheeprl, ...).
SUPPORTED += [
    ("fabric.fabric", "Fabric"),
    ("fabric.utilities.cloud_io", "_is_dir"),
    ("fabric.wrappers", "_unwrap_objects"),
    ("fabric.utilities.distributed", "DistributedSamplerWrapper"),
    ("fabric.plugins.precision.bitsandbytes", "BitsandbytesPrecision"),
    ("fabric.plugins.precision.deepspeed", "DeepSpeedPrecision"),
    ("fabric.plugins.precision.fsdp", "FSDPPrecision"),
    ("fabric.plugins.precision.transformer_engine", "TransformerEnginePrecision"),
    ("fabric.accelerators.registry", "_AcceleratorRegistry"),
    ("fabric.accelerators.registry", "ACCELERATOR_REGISTRY"),
    ("fabric.strategies.registry", "_StrategyRegistry"),
    ("fabric.strategies.registry", "STRATEGY_REGISTRY"),
    ("fabric.utilities.spike", "SpikeDetection"),
    ("fabric.utilities.spike", "TrainingSpikeException"),
    *(
        ("fabric.connector", n)
        for n in ("_PRECISION_INPUT", "_PRECISION_INPUT_STR", "_PLUGIN_INPUT", "_convert_precision_to_unified_args")
    ),
    ("fabric.utilities.registry", "_load_external_callbacks"),
    ("fabric.utilities.testing", "_runif_reasons"),
    ("fabric.utilities.consolidate_checkpoint", "_process_cli_args"),
    ("fabric.utilities.logger", "_convert_params"),
    ("fabric.utilities.logger", "_flatten_dict"),
    ("fabric.utilities.rank_zero", "_get_rank"),
    ("fabric.utilities.types", "_TORCH_LRSCHEDULER"),
    ("fabric.utilities.imports", "_TORCH_GREATER_EQUAL_2_0"),
    ("fabric.utilities.imports", "_TORCH_GREATER_EQUAL_2_1"),
    *(
        ("fabric.utilities.distributed", n)
        for n in (
            "_distributed_is_initialized",
            "_sync_ddp_if_available",
            "_all_gather_ddp_if_available",
            "_get_default_process_group_backend_for_device",
        )
    ),
    *(
        ("fabric.accelerators.cuda", n)
        for n in ("CUDAAccelerator", "find_usable_cuda_devices", "is_cuda_available", "num_cuda_devices")
    ),
]
# Names under fabric.plugins that are not plugin classes (so not in the plugin-identity check below).
FUNCTION_PATHS: list[tuple[str, str]] = [
    ("fabric.plugins.environments.lightning", "find_free_network_port"),
    ("fabric.plugins.collectives.collective", "CollectibleGroup"),
    ("fabric.plugins.collectives.torch_collective", "default_pg_timeout"),
    ("fabric.plugins.precision.utils", "_convert_fp_tensor"),
    ("fabric.plugins.precision.utils", "_DtypeContextManager"),
]

# TPUs through XLA (the classes import without torch_xla; using them needs it).
XLA_PATHS: list[tuple[str, str]] = [
    ("fabric.accelerators.xla", "XLAAccelerator"),
    ("fabric.strategies", "XLAStrategy"),
    ("fabric.strategies", "XLAFSDPStrategy"),
    ("fabric.strategies", "SingleDeviceXLAStrategy"),
    ("fabric.strategies.xla", "XLAStrategy"),
    ("fabric.strategies.single_xla", "SingleDeviceXLAStrategy"),
    ("fabric.strategies.xla_fsdp", "XLAFSDPStrategy"),
    ("fabric.plugins", "XLAPrecision"),
    ("fabric.plugins.precision", "XLAPrecision"),
    ("fabric.plugins.precision.xla", "XLAPrecision"),
    ("fabric.plugins", "XLACheckpointIO"),
    ("fabric.plugins.io", "XLACheckpointIO"),
    ("fabric.plugins.io.xla", "XLACheckpointIO"),
    ("fabric.plugins.environments", "XLAEnvironment"),
    ("fabric.plugins.environments.xla", "XLAEnvironment"),
]
SUPPORTED += XLA_PATHS


def _import(path: str, name: str) -> object:
    module = importlib.import_module(path)
    if not hasattr(module, name):
        raise ImportError(f"cannot import name {name!r} from {path!r}")
    return getattr(module, name)


@pytest.mark.parametrize(
    ("path", "name"), SUPPORTED + FUNCTION_PATHS, ids=[f"{p}.{n}" for p, n in SUPPORTED + FUNCTION_PATHS]
)
def test_lightning_import_path_exists(path: str, name: str) -> None:
    assert _import(path, name) is not None


def test_plugin_paths_are_our_own_classes_not_copies() -> None:
    from fabric import collectives, environments, io, precision, strategies
    from fabric.plugins import environments as plugin_envs
    from fabric.plugins import io as plugin_io
    from fabric.plugins import precision as plugin_precision

    for path, name in SUPPORTED:
        if path.startswith("fabric.plugins"):
            ours = [getattr(m, name) for m in (precision, environments, io, collectives) if hasattr(m, name)]
            assert ours == [_import(path, name)], (path, name)
            assert inspect.getmodule(ours[0]).__name__.startswith(
                ("fabric.precision", "fabric.environments", "fabric.io", "fabric.collectives")
            )
    assert plugin_precision.MixedPrecision is precision.MixedPrecision is fabric.MixedPrecision
    assert plugin_envs.LightningEnvironment is environments.DefaultEnvironment
    assert plugin_io.TorchCheckpointIO is io.TorchCheckpointIO
    assert _import("fabric.strategies", "DDPStrategy") is strategies.DDPStrategy is fabric.DDPStrategy


def test_no_listed_module_imports_an_optional_heavy_dependency() -> None:
    import subprocess
    import sys

    modules = sorted({path for path, _ in SUPPORTED + FUNCTION_PATHS})
    code = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        "heavy = ('lightning', 'lightning_fabric', 'lightning_utilities', 'deepspeed', 'fsspec', 'tensorboard', "
        "'torch_xla')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"


def test_rank_zero_only_rank_exists_and_is_honoured() -> None:
    from fabric.utilities import rank_zero_only

    calls: list[int] = []
    guarded = rank_zero_only(calls.append, default="skipped")
    assert rank_zero_only.rank == 0  # a plain process (the test session) is rank 0
    try:
        rank_zero_only.rank = 1
        assert guarded(1) == "skipped"
        rank_zero_only.rank = 0
        assert guarded(2) is None
    finally:
        rank_zero_only.rank = None  # back to detection
    assert calls == [2]


def test_version_flags_describe_the_installed_torch() -> None:
    from fabric.utilities import imports

    # torch >= 2.13 is required, so every "at least 2.x" flag is true and the "at most 2.6" one false
    assert imports._TORCH_GREATER_EQUAL_2_6 and imports._TORCH_GREATER_EQUAL_2_3
    assert not imports._TORCH_LESS_EQUAL_2_6 and not imports._TORCH_EQUAL_2_4_0
    assert imports._NUMPY_AVAILABLE is (importlib.util.find_spec("numpy") is not None)


def test_misconfiguration_exception_catches_fabric_errors_through_the_lightning_path() -> None:
    from fabric.utilities.exceptions import MisconfigurationException

    with pytest.raises(MisconfigurationException, match="unknown strategy"):
        fabric.Fabric(strategy="ddp_spwan")


def test_is_wrapped_recognises_what_setup_returned() -> None:
    import torch
    from torch.utils.data import DataLoader

    f = fabric.Fabric(accelerator="cpu", devices=1)
    model = torch.nn.Linear(2, 2)
    wrapped = f.setup(model)
    loader = f.setup_dataloaders(DataLoader(list(range(4))))
    assert fabric.is_wrapped(wrapped) and fabric.is_wrapped(loader)
    assert not fabric.is_wrapped(model)


def test_private_names_behave_as_lightnings(tmp_path: Path) -> None:
    import torch
    from fsspec.implementations.local import LocalFileSystem
    from torch.utils.data import DataLoader

    from fabric.accelerators import ACCELERATOR_REGISTRY
    from fabric.accelerators.cuda import is_cuda_available, num_cuda_devices
    from fabric.strategies import STRATEGY_REGISTRY
    from fabric.utilities.cloud_io import _is_dir
    from fabric.utilities.data import DistributedSamplerWrapper
    from fabric.utilities.distributed import DistributedSamplerWrapper as from_distributed
    from fabric.wrappers import _unwrap_objects

    f = fabric.Fabric(accelerator="cpu", devices=1)
    assert f._precision is f.strategy.precision
    layer = torch.nn.Linear(2, 2)
    model, optimizer = f.setup(layer, torch.optim.SGD(layer.parameters()))
    loader = f.setup_dataloaders(DataLoader(list(range(4))))
    # the loader becomes the DataLoader the wrapper iterates (Lightning's `_dataloader`, as here)
    unwrapped = _unwrap_objects({"model": model, "rest": [optimizer, loader, 3]})
    assert unwrapped["model"] is layer and unwrapped["rest"][0] is optimizer.optimizer
    assert unwrapped["rest"][1] is loader._dataloader and unwrapped["rest"][2] == 3
    assert "ddp" in STRATEGY_REGISTRY.available_strategies() and "cpu" in ACCELERATOR_REGISTRY.available_accelerators()
    assert num_cuda_devices() == torch.cuda.device_count() and is_cuda_available() is (num_cuda_devices() > 0)
    assert from_distributed is DistributedSamplerWrapper
    fs = LocalFileSystem()
    (tmp_path / "file").write_text("x")
    assert _is_dir(fs, tmp_path) and not _is_dir(fs, tmp_path / "file") and not _is_dir(fs, tmp_path / "missing")


def test_is_dir_on_an_object_store_accepts_any_path_that_is_not_a_file() -> None:
    from fabric.utilities.cloud_io import _is_dir

    class _Store:
        protocol = ("s3", "s3a")

        def isdir(self, path: str) -> bool:
            return False

        def isfile(self, path: str) -> bool:
            return path.endswith(".ckpt")

    store: Any = _Store()
    assert _is_dir(store, "s3://bucket/new/dir") and not _is_dir(store, "s3://bucket/new/dir", strict=True)
    assert not _is_dir(store, "s3://bucket/last.ckpt")
