"""`import fabric` leaves the strategies, precisions and loggers a run may never use unimported (fabric/_lazy.py),
and every exported name still reads as before: the same objects, through any import path."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import fabric
import fabric.loggers
import fabric.precision
import fabric.strategies

LAZY_MODULES = (
    "fabric.strategies.deepspeed",
    "fabric.strategies.dp",
    "fabric.strategies.fairscale",
    "fabric.strategies.fsdp",
    "fabric.strategies.model_parallel",
    "fabric.strategies.pipeline",
    "fabric.strategies.xla",
    "fabric.precision.bitsandbytes",
    "fabric.precision.deepspeed",
    "fabric.precision.fsdp",
    "fabric.precision.transformer_engine",
    "fabric.precision.xla",
    "fabric.loggers.tensorboard",
)


def _fresh(code: str) -> str:
    """Run `code` in a new interpreter (this one has imported everything already) and return what it printed."""
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_import_fabric_skips_the_modules_of_strategies_a_run_may_not_use() -> None:
    loaded = _fresh(f"""
        import sys, fabric
        print(sorted(m for m in {LAZY_MODULES!r} if m in sys.modules))
        """)
    assert loaded == "[]"


def test_a_lazy_name_is_imported_on_first_read_and_is_the_same_object_everywhere() -> None:
    printed = _fresh("""
        import sys
        from fabric import DeepSpeedStrategy
        from fabric.strategies import STRATEGY_REGISTRY, XLAStrategy
        import fabric.strategies.deepspeed as deepspeed_module
        from fabric.plugins import FSDPPrecision
        import fabric.precision.fsdp as fsdp_precision
        print(DeepSpeedStrategy is deepspeed_module.DeepSpeedStrategy)
        print(STRATEGY_REGISTRY.factory_of("deepspeed_stage_3") is DeepSpeedStrategy)
        print(FSDPPrecision is fsdp_precision.FSDPPrecision, XLAStrategy.__module__)
        print("fabric.strategies.fsdp" in sys.modules, "fabric.loggers.tensorboard" in sys.modules)
        """)
    # FSDPPrecision's module imports no FSDP strategy; only what was read got imported.
    assert printed.splitlines() == ["True", "True", "True fabric.strategies.xla.ddp", "False False"]


def test_a_strategy_name_imports_its_module_when_a_fabric_asks_for_it() -> None:
    printed = _fresh("""
        import sys
        from fabric import Fabric
        before = "fabric.strategies.dp" in sys.modules
        try:
            Fabric(strategy="dp", accelerator="cpu")
        except ValueError as err:  # DataParallel needs GPUs: the point is that the name was found and resolved
            print(type(err).__name__)
        print(before, "fabric.strategies.dp" in sys.modules)
        """)
    assert printed.splitlines()[-1] == "False True"


@pytest.mark.parametrize("package", [fabric, fabric.strategies, fabric.precision, fabric.loggers])
def test_every_exported_name_reads_and_is_listed(package: object) -> None:
    names = package.__all__  # type: ignore[attr-defined]
    assert [name for name in names if not hasattr(package, name)] == []
    assert set(names) <= set(dir(package))


def test_an_unknown_name_is_an_attribute_error_as_from_any_module() -> None:
    with pytest.raises(AttributeError, match=r"module 'fabric.strategies' has no attribute 'DeepspeedStrategy'"):
        _ = fabric.strategies.DeepspeedStrategy  # type: ignore[attr-defined]
    with pytest.raises(ImportError, match=r"cannot import name 'TensorboardLogger' from 'fabric.loggers'"):
        from fabric.loggers import TensorboardLogger  # type: ignore[attr-defined]  # noqa: F401
    # A plain module that exports lazily (Lightning's path for the sampler wrapper) has no submodules to look for.
    import fabric.utilities.distributed as distributed

    with pytest.raises(AttributeError, match=r"module 'fabric.utilities.distributed' has no attribute 'Sampler'"):
        _ = distributed.Sampler  # type: ignore[attr-defined]
    assert "DistributedSamplerWrapper" in dir(distributed)


def test_star_import_still_brings_every_name() -> None:
    namespace: dict[str, object] = {}
    exec("from fabric.strategies import *", namespace)  # the statement under test
    assert set(fabric.strategies.__all__) <= set(namespace)


def test_a_submodule_reads_as_an_attribute_as_when_the_package_imported_it() -> None:
    printed = _fresh("""
        import fabric
        print(fabric.strategies.deepspeed.DeepSpeedStrategy.__name__, fabric.precision.fsdp.FSDPPrecision.__name__)
        print(fabric.loggers.tensorboard.TensorBoardLogger is fabric.loggers.TensorBoardLogger)
        print(hasattr(fabric.strategies, "no_such_submodule"))
        """)
    assert printed.splitlines() == ["DeepSpeedStrategy FSDPPrecision", "True", "False"]
