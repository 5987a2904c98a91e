"""``_runif_reasons``: why a test needing some hardware or versions cannot run here (Lightning's signature)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import torch


def _base_version(text: str) -> tuple[int, ...]:
    # "2.13.0.dev20250101+cu128" -> (2, 13, 0): nightlies count as their release, as in Lightning
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"_runif_reasons: version {text!r} is not of the form MAJOR.MINOR[.PATCH]. Pass e.g. '2.4'.")
    return tuple(int(part or 0) for part in match.groups())


def _runif_reasons(
    *,
    min_cuda_gpus: int = 0,
    min_torch: str | None = None,
    max_torch: str | None = None,
    min_python: str | None = None,
    bf16_cuda: bool = False,
    tpu: bool = False,
    mps: bool | None = None,
    skip_windows: bool = False,
    standalone: bool = False,
    deepspeed: bool = False,
    dynamo: bool = False,
    linux_only: bool = False,
) -> tuple[list[str], dict[str, bool]]:
    """The reasons to skip (empty: the test can run) and the markers a conftest uses to select tests.

    ``min_cuda_gpus``, ``tpu`` and ``standalone`` also set the marker of that name; ``standalone`` needs
    ``PL_RUN_STANDALONE_TESTS=1``; ``mps=False`` requires that no MPS device is available.
    """
    from fabric.accelerators.cuda import num_cuda_devices
    from fabric.accelerators.mps import MPSAccelerator
    from fabric.accelerators.xla import XLAAccelerator

    reasons: list[str] = []
    markers: dict[str, bool] = {}
    torch_version = _base_version(torch.__version__)
    if min_cuda_gpus:
        if num_cuda_devices() < min_cuda_gpus:
            reasons.append(f"GPUs>={min_cuda_gpus}")
        markers["min_cuda_gpus"] = True
    if min_torch and torch_version < _base_version(min_torch):
        reasons.append(f"torch>={min_torch}, {torch.__version__} installed")
    if max_torch and torch_version >= _base_version(max_torch):
        reasons.append(f"torch<{max_torch}, {torch.__version__} installed")
    if min_python and sys.version_info[:3] < _base_version(min_python):
        reasons.append(f"python>={min_python}")
    if bf16_cuda and not (num_cuda_devices() > 0 and torch.cuda.is_bf16_supported()):
        reasons.append("CUDA device bf16")
    if skip_windows and sys.platform == "win32":
        reasons.append("unimplemented on Windows")
    if tpu:
        if not XLAAccelerator.is_available():
            reasons.append("TPU")
        markers["tpu"] = True
    if mps is not None and mps != MPSAccelerator.is_available():
        reasons.append("MPS" if mps else "not MPS")
    if standalone:
        if os.getenv("PL_RUN_STANDALONE_TESTS", "0") != "1":
            reasons.append("Standalone execution")
        markers["standalone"] = True
    if deepspeed and importlib.util.find_spec("deepspeed") is None:
        reasons.append("Deepspeed")
    if dynamo:
        from torch._dynamo.eval_frame import is_dynamo_supported

        if not is_dynamo_supported():
            reasons.append("torch.dynamo")
    if linux_only and sys.platform != "linux":
        reasons.append("only linux")
    return reasons, markers
