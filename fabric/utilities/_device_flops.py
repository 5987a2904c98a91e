"""Peak FLOP/s of one GPU per dtype (dense, no sparsity), from the vendors' datasheets, for MFU estimates."""

from __future__ import annotations

import torch

# "tfloat32" is float32 matmuls on tensor cores (TF32), which torch uses on Ampere and later unless
# torch.get_float32_matmul_precision() is "highest".
_TF32 = "tfloat32"
_Table = dict[str | torch.dtype, float]


def _ampere_like(fp32: float, tf32: float, half: float, int8: float) -> _Table:
    return {torch.float32: fp32, _TF32: tf32, torch.bfloat16: half, torch.float16: half, torch.int8: int8}


CUDA_FLOPS: dict[str, _Table] = {
    # H200 has H100 SXM's compute (only its memory differs); NVL cards run at a lower clock.
    "h200 sxm": {torch.float64: 33.5e12, **_ampere_like(66.9e12, 494.7e12, 989.4e12, 1978.9e12)},
    "h200 nvl": {torch.float64: 30e12, **_ampere_like(60e12, 417.5e12, 835.5e12, 1670.5e12)},
    "h100 sxm": {torch.float64: 33.5e12, **_ampere_like(66.9e12, 494.7e12, 989.4e12, 1978.9e12)},
    "h100 nvl": {torch.float64: 30e12, **_ampere_like(60e12, 417.5e12, 835.5e12, 1670.5e12)},
    "h100 pcie": {torch.float64: 25.6e12, **_ampere_like(51.2e12, 378e12, 756e12, 1513e12)},
    "a100": {torch.float64: 9.7e12, **_ampere_like(19.5e12, 156e12, 312e12, 624e12)},
    "a10g": _ampere_like(31.2e12, 62.5e12, 125e12, 250e12),
    "a40": _ampere_like(37.4e12, 74.8e12, 37.4e12, 299.3e12),
    "a6000": _ampere_like(38.7e12, 77.4e12, 38.7e12, 309.7e12),
    "l4": _ampere_like(30.3e12, 60e12, 121e12, 242e12),
    "l40": _ampere_like(90.5e12, 90.5e12, 181e12, 362e12),
    "rtx 4090": _ampere_like(82.6e12, 82.6e12, 82.6e12, 660.6e12),
    "rtx 3090": _ampere_like(35.6e12, 35.6e12, 35.6e12, 284e12),
    "t4": {torch.float32: 8.1e12, torch.float16: 65e12, torch.int8: 130e12},
    "v100 sxm": {torch.float64: 7.8e12, torch.float32: 15.7e12, torch.float16: 125e12},
    "v100 pcie": {torch.float64: 7e12, torch.float32: 14e12, torch.float16: 112e12},
    "v100s pcie": {torch.float64: 8.2e12, torch.float32: 16.4e12, torch.float16: 130e12},
}

# (substrings that must all be in the lower-cased device name, table key); the first match wins, so
# the more specific names come first.
_NAME_RULES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("h200", "nvl"), "h200 nvl"),
    (("h200",), "h200 sxm"),
    (("h100", "nvl"), "h100 nvl"),
    (("h100", "pcie"), "h100 pcie"),
    (("h100", "hbm2e"), "h100 pcie"),
    (("h100",), "h100 sxm"),
    (("a100",), "a100"),
    (("a10g",), "a10g"),
    (("a6000",), "a6000"),
    (("a40",), "a40"),
    (("l40",), "l40"),
    (("l4",), "l4"),
    (("4090",), "rtx 4090"),
    (("3090",), "rtx 3090"),
    (("t4",), "t4"),
    (("v100s",), "v100s pcie"),
    (("v100", "pcie"), "v100 pcie"),
    (("v100",), "v100 sxm"),
)


def chip_of(device_name: str) -> str | None:
    """The table key for a CUDA device name such as ``'NVIDIA H100 80GB HBM3'``, or None if unknown."""
    name = device_name.lower()
    for parts, chip in _NAME_RULES:
        if all(part in name for part in parts):
            return chip
    return None
