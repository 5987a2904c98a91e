"""Two DDP processes making the mistakes only several processes expose, next to a correct loop.

Usage: python mistakes_ddp.py OUTDIR. strategy="ddp" re-runs this script for rank 1. Each rank writes
OUTDIR/rank{N}.json with:
- backward_warnings: the warnings of fabric.backward on a loss from a model that was never set up, and
  backward_grads_equal: whether its gradients are equal across ranks (not: nobody averaged them);
- setup_warnings: the warnings of fabric.setup with an optimizer that also holds a parameter outside the model;
- correct_warnings: the warnings of a correct training loop (must be none), and whether its weights stayed equal
  across ranks and equal to raw torch DDP's; hooks_in_wrapped_forward: the original module's forward pre-hooks
  seen while the returned model ran it (none expected: the guard is lifted, so torch's fast path runs);
- unwrapped_warnings: the warnings of two training steps through the original module (one expected), of an
  inference call on it under torch.no_grad() (none expected), and whether the weights then differ across ranks.
Then it ends as a user's script may: destroy_process_group() while a gather is still in flight, and the model
fabric.setup returned freed after it (see `free_model_after_destroy`); OUTDIR/rank{N}.end.json says whether that
freed the group. Before fabric released DDP's hold on the group through Python, rank 0 hung there for good.
"""

from __future__ import annotations

import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _it_common import outdir_from_argv, write_json
from torch import nn

from fabric import Fabric


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def batch(rank: int, step: int) -> torch.Tensor:
    # Different data on each rank: gradients that are not averaged make the replicas differ.
    return torch.full((2, 4), float(rank + 1 + step))


def caught(action: Callable[[], Any]) -> list[str]:
    """The warnings `action` gives, every one recorded (Python's own once-per-line filter off)."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        action()
    return [str(r.message) for r in records]


def flat(model: nn.Module) -> torch.Tensor:
    """Every parameter of `model`, detached, in one flat tensor."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def equal_across_ranks(fabric: Fabric, model: nn.Module) -> bool:
    gathered = fabric.all_gather(flat(model))
    return bool(torch.equal(gathered[0], gathered[1]))


def raw_ddp_weights(rank: int, steps: int) -> torch.Tensor:
    """The same loop in plain torch DDP, on the process group fabric created."""
    model = nn.parallel.DistributedDataParallel(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        model(batch(rank, step)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    return flat(model)


def free_model_after_destroy(rank: int, state: dict[str, Any]) -> bool:
    """Destroy the group while gloo still runs a gather, then free the DDP model; True if that freed the group.

    The gather's tensors are created here and dropped at once, so gloo's worker thread releases them (it needs the
    GIL for that) after rank 1 joins, a second later; by then rank 0 has freed the model, the group's last holder.
    """
    group = weakref.ref(dist.group.WORLD)
    if rank == 1:
        time.sleep(1)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the new name in torch 2.13
    gather(torch.empty(2 * 3), torch.ones(3), async_op=True)
    dist.destroy_process_group()
    state.clear()  # the model fabric.setup returned, and its optimizer
    return group() is None


def main() -> None:
    out = outdir_from_argv()
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    rank = fabric.global_rank
    report: dict[str, Any] = {}

    never_set_up = make_model()
    report["backward_warnings"] = caught(lambda: fabric.backward(never_set_up(batch(rank, 0)).sum()))
    grads = torch.cat([p.grad.reshape(-1) for p in never_set_up.parameters()])  # type: ignore[union-attr]
    gathered = fabric.all_gather(grads)
    report["backward_grads_equal"] = bool(torch.equal(gathered[0], gathered[1]))

    module = make_model()
    extra = nn.Parameter(torch.ones(1))  # e.g. a learnable loss weight kept outside the model
    optimizer = torch.optim.SGD([*module.parameters(), extra], lr=0.1)
    report["setup_warnings"] = caught(lambda: fabric.setup(module, optimizer))

    original = make_model()
    state: dict[str, Any] = {}

    # How many forward pre-hooks the original module has while the returned model runs it (inside DDP): none
    # means torch's fast Module.__call__ path, as in raw DDP. Read by a hook on its first layer, not on itself.
    hooks_in_forward: list[int] = []
    original[0].register_forward_hook(lambda *_: hooks_in_forward.append(len(original._forward_pre_hooks)))

    def train_correctly() -> None:
        model, opt = fabric.setup(original, torch.optim.SGD(original.parameters(), lr=0.1))
        for step in range(3):
            fabric.backward(model(batch(rank, step)).sum())
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            original(batch(rank, 0))  # inference on the original module: nothing can drift
        state["model"], state["opt"] = model, opt

    report["correct_warnings"] = caught(train_correctly)
    report["hooks_in_wrapped_forward"] = hooks_in_forward[:3]  # the fourth call is the no_grad one, unwrapped
    report["correct_equal"] = equal_across_ranks(fabric, original)
    fabric_weights = torch.cat([p.detach().reshape(-1) for p in original.parameters()])
    report["matches_raw_ddp"] = bool(torch.equal(fabric_weights, raw_ddp_weights(rank, 3)))

    def train_through_original() -> None:
        opt = state["opt"]
        for step in range(2):
            fabric.backward(original(batch(rank, step)).sum())  # the mistake: the module, not the returned model
            opt.step()
            opt.zero_grad()

    report["unwrapped_warnings"] = caught(train_through_original)
    report["unwrapped_equal"] = equal_across_ranks(fabric, original)
    write_json(out / f"rank{rank}.json", report)
    write_json(out / f"rank{rank}.end.json", {"group_freed_with_model": free_model_after_destroy(rank, state)})


if __name__ == "__main__":
    main()
