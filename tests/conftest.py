"""Shared fixtures: every test leaves no process group and the environment variables it found."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist

# pytest-xdist's workers ignore SIGINT (the controller handles Ctrl-C), and an ignored signal stays ignored in
# every process they start: the scripts the signal tests start would then never see their Ctrl-C. Give the
# worker Python's own handler back, so that its children start with the default, as under a plain pytest run.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def _clean_process_state() -> Iterator[None]:
    env = dict(os.environ)
    default_dtype = torch.get_default_dtype()
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    torch.set_default_dtype(default_dtype)
    os.environ.clear()
    os.environ.update(env)


# Every variable a scheduler or launcher sets that fabric reads: a test that needs "a plain python run"
# removes them all, whatever the shell running pytest (an srun step, a torchrun worker) had set.
_CLUSTER_PREFIXES = ("SLURM_", "LSB_", "JSM_", "OMPI_", "PMI_", "MV2_", "MASTER_")
_CLUSTER_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                  "KUBERNETES_PORT", "NODE_RANK")  # fmt: skip


@pytest.fixture
def no_cluster_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start the test as a plain `python script.py` would: no scheduler or launcher variables."""
    for name in list(os.environ):
        if name.startswith(_CLUSTER_PREFIXES) or name in _CLUSTER_NAMES:
            monkeypatch.delenv(name)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip hardware-specific tests, with the reason, where the hardware is missing."""
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    skip_mps = pytest.mark.skip(reason="needs an Apple MPS device; none is available")
    for item in items:
        if "cuda" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_cuda)
        if "mps" in item.keywords and not torch.backends.mps.is_available():
            item.add_marker(skip_mps)
