"""xla_spmd scenarios, each run in a fresh process (SPMD mode and the device count are fixed once torch_xla starts).

Usage: python spmd_scenarios.py SCENARIO[,SCENARIO...] OUTDIR. Writes OUTDIR/result.json ({scenario: result}),
which the tests assert on. Several scenarios share one process: starting torch_xla takes seconds.
Run with PJRT_DEVICE=CPU CPU_NUM_DEVICES=4 (four virtual XLA devices on the CPU).
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from fabric import Fabric
from fabric.strategies import XLASPMDStrategy

STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(8 * STEPS, 8, generator=generator), torch.randint(0, 4, (8 * STEPS,), generator=generator)
    )


def _eager(model: nn.Module, dtype: torch.dtype = torch.float32, clip: float | None = None) -> nn.Module:
    """The same loop in plain eager PyTorch on the CPU: the reference."""
    model = model.to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    for x, y in DataLoader(_data(), batch_size=8):
        loss = nn.functional.cross_entropy(model(x.to(dtype)).float(), y)
        optimizer.zero_grad()
        loss.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return model


def _spec(tensor: torch.Tensor) -> str:
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def _train(
    fabric: Fabric, model: nn.Module, clip: float | None = None, two_step: bool = False
) -> tuple[Any, Any, list[list[str]]]:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)  # on the CPU parameters, before any setup
    if two_step:
        model = fabric.setup_module(model)
        optimizer = fabric.setup_optimizers(optimizer)
    else:
        model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(_data(), batch_size=8))
    batch_specs = []
    for x, y in loader:
        batch_specs.append([_spec(x), _spec(y)])
        loss = nn.functional.cross_entropy(model(x).float(), y)
        optimizer.zero_grad()
        fabric.backward(loss)
        if clip is not None:
            fabric.clip_gradients(model, optimizer, max_norm=clip)
        optimizer.step()
    return model, optimizer, batch_specs


def _max_diff(model: nn.Module, reference: nn.Module) -> float:
    ours = dict(model.named_parameters())
    return max((ours[name].cpu().float() - p.float()).abs().max().item() for name, p in reference.named_parameters())


def train(fabric: Fabric) -> dict[str, Any]:
    model = _model()
    reference = _eager(copy.deepcopy(model))
    wrapped, _, batch_specs = _train(fabric, model)
    x = torch.ones(2, device=fabric.device)
    return {
        "max_diff": _max_diff(model, reference),
        "param_specs": {name: _spec(p) for name, p in model.named_parameters()},
        "batch_specs": batch_specs,
        "world_size": fabric.world_size,
        "global_rank": fabric.global_rank,
        "device": str(fabric.device),
        "all_reduce": fabric.all_reduce(x, reduce_op="sum").cpu().tolist(),
        "all_gather_shape": list(fabric.all_gather(x).shape),
        "wrapper": type(wrapped._forward_module).__name__,
    }


def clipped(fabric: Fabric) -> dict[str, Any]:
    """Gradient-norm clipping over sharded gradients: the norm is the whole model's, as in eager."""
    model = _model()
    reference = _eager(copy.deepcopy(model), clip=0.1)
    _train(fabric, model, clip=0.1)
    return {"max_diff": _max_diff(model, reference)}


def two_step_setup(fabric: Fabric) -> dict[str, Any]:
    """setup_module, then setup_optimizers with an optimizer built on the CPU parameters."""
    model = _model()
    reference = _eager(copy.deepcopy(model))
    _train(fabric, model, two_step=True)
    return {"max_diff": _max_diff(model, reference)}


def foreign_checkpoint(fabric: Fabric, outdir: Path) -> dict[str, Any]:
    """A DCP directory written by plain torch on the CPU (as an fsdp run's would be) loads into sharded weights."""
    import torch.distributed.checkpoint as dcp

    source = _model()
    with torch.no_grad():
        for p in source.parameters():
            p.mul_(2.0)
    dcp.save({"model": source.state_dict(), "epoch": 7}, storage_writer=dcp.FileSystemWriter(outdir / "foreign"))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    state = {"model": fabric.setup(model), "epoch": 0}
    fabric.load(outdir / "foreign", state)
    # load_raw: a DCP directory holding one module's state dict, keyed by parameter name.
    dcp.save(source.state_dict(), storage_writer=dcp.FileSystemWriter(outdir / "raw"))
    raw = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fabric.load_raw(outdir / "raw", fabric.setup(raw))
    return {
        "epoch": state["epoch"],
        "diff": _max_diff(model, source),
        "specs": {name: _spec(p) for name, p in model.named_parameters()},
        "raw_diff": _max_diff(raw, source),
    }


def checkpoint(fabric: Fabric, outdir: Path) -> dict[str, Any]:
    model = _model()
    _, optimizer, _ = _train(fabric, model)
    fabric.save(outdir / "ckpt", {"model": model, "optimizer": optimizer, "step": STEPS})
    # What a CPU run must find in the checkpoint: whole tensors, by parameter name.
    names = {id(p): name for name, p in model.named_parameters()}
    expected = {
        "model": {name: t.cpu() for name, t in model.state_dict().items()},
        "exp_avg": {names[id(p)]: s["exp_avg"].cpu() for p, s in optimizer.state.items()},
    }
    torch.save(expected, outdir / "expected.pt")
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=0.05)
    state = {"model": fabric.setup(fresh, fresh_optimizer)[0], "optimizer": fresh_optimizer, "step": 0}
    fabric.load(outdir / "ckpt", state)
    own = dict(fresh.named_parameters())
    return {
        "files": sorted(p.name for p in (outdir / "ckpt").iterdir()),
        "step": state["step"],
        "reload_diff": _max_diff(model, fresh),
        "reload_specs": {name: _spec(p) for name, p in own.items()},
        "exp_avg_diff": max(
            (fresh_optimizer.state[own[name]]["exp_avg"].cpu() - t).abs().max().item()
            for name, t in expected["exp_avg"].items()
        ),
    }


def full_checkpoint(fabric: Fabric, outdir: Path) -> dict[str, Any]:
    model = _model()
    _, optimizer, _ = _train(fabric, model)
    fabric.save(outdir / "full.ckpt", {"model": model, "optimizer": optimizer})
    saved = torch.load(outdir / "full.ckpt", weights_only=True)
    fresh = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    fabric.load(outdir / "full.ckpt", {"model": fabric.setup(fresh)}, strict=False)
    return {
        "is_file": (outdir / "full.ckpt").is_file(),
        "devices": sorted({str(t.device) for t in saved["model"].values()}),
        "reload_diff": _max_diff(model, fresh),
        "reload_specs": {name: _spec(p) for name, p in fresh.named_parameters()},
    }


def bf16(fabric: Fabric) -> dict[str, Any]:
    model = _model()
    dtype = torch.bfloat16 if fabric.strategy.precision.precision == "bf16-true" else torch.float32
    reference = _eager(copy.deepcopy(model), dtype)
    computed: list[str] = []
    model[0].register_forward_hook(lambda module, args, output: computed.append(str(output.dtype)))
    _train(fabric, model)
    return {
        "dtype": str(next(model.parameters()).dtype),
        "compute_dtypes": sorted(set(computed)),
        "max_diff": _max_diff(model, reference),
    }


def plan_errors(fabric: Fabric) -> dict[str, Any]:
    """Plans that pass the constructor's checks but do not fit the model: refused at setup, naming the entry."""
    errors = {}
    for name, plan in {"no_match": {"encoder.*": ("model", None)}, "rank": {"0.bias": ("model", None)}}.items():
        planned = Fabric(accelerator="xla", strategy=XLASPMDStrategy(sharding_plan=plan))
        planned.launch()
        try:
            planned.setup(_model())
        except ValueError as err:
            errors[name] = str(err)
    return errors


SCENARIOS: dict[str, tuple[Callable[..., dict[str, Any]], dict[str, Any]]] = {
    "fsdp": (train, {}),
    "data_parallel": (train, {"mesh_shape": (4,), "axis_names": ("data",)}),
    "hybrid": (train, {"mesh_shape": (2, 2, 1)}),
    "tensor_parallel": (
        train,
        {"mesh_shape": (2, 2), "sharding_plan": {"0.weight": ("model", None), "2.weight": (None, "model")}},
    ),
    "checkpoint": (checkpoint, {"sharding_plan": {"2.weight": (None, "model")}, "mesh_shape": (2, 2)}),
    "full_checkpoint": (full_checkpoint, {"state_dict_type": "full"}),
    "foreign_checkpoint": (foreign_checkpoint, {}),
    "clipped": (clipped, {}),
    "two_step_setup": (two_step_setup, {}),
    "bf16-true": (bf16, {}),
    "bf16-mixed": (bf16, {}),
    "plan_errors": (plan_errors, {}),
}


def main() -> None:
    names, outdir = sys.argv[1].split(","), Path(sys.argv[2])
    warnings.filterwarnings("ignore")  # torch_xla's deprecation notes would drown the output
    results = {}
    for name in names:  # meshes and Fabric objects are per scenario; SPMD mode is set once for the process
        function, kwargs = SCENARIOS[name]
        precision = name if name.startswith("bf16") else None
        fabric = Fabric(accelerator="xla", strategy=XLASPMDStrategy(**kwargs), precision=precision)
        fabric.launch()
        args = (fabric, outdir) if function in (checkpoint, full_checkpoint, foreign_checkpoint) else (fabric,)
        results[name] = function(*args)
    (outdir / "result.json").write_text(json.dumps(results))


if __name__ == "__main__":
    main()
