"""Mixed precision on one CUDA GPU: step time and peak memory of fabric's precision settings against raw PyTorch.

For each of `32-true`, `bf16-mixed` and `16-mixed`, a mid-size transformer (token embedding, 6 encoder layers of
width 512, 8 heads, a vocabulary head; about 25M parameters) trains with AdamW on random tokens:
  raw torch   32-true: plain; bf16-mixed: torch.autocast('cuda', torch.bfloat16) around forward and loss;
              16-mixed: autocast to float16 and torch.amp.GradScaler (scale, step, update)
  fabric      Fabric(accelerator='cuda', devices=1, precision=...), setup, fabric.backward
and, with --peer-python, Lightning Fabric (same flags) and Accelerate (mixed_precision='no'/'bf16'/'fp16').
Each contender runs in a fresh process: warmup, reset the peak-memory counter, then R repeats of K steps timed
with torch.cuda.synchronize() around them. Reported: ms per step (steps/s in the note) and
torch.cuda.max_memory_allocated over the timed steps, with ratios to raw torch at the same precision.

Needs a CUDA GPU; without one it says so and exits with status 1.
Run:  python benchmarks/cuda_precision.py [--rounds 3] [--peer-python /path/to/bench-venv/bin/python]
      python benchmarks/cuda_precision.py --device cpu [--smoke]  # runs 32-true and bf16-mixed on the CPU
                                   # (--smoke: bf16-mixed, a tiny model): checks code paths, says nothing of a GPU
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from _common import Row, emit, print_table, run_json
from _common import contenders as common_contenders

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
ACCELERATE_NAMES = {"32-true": "no", "bf16-mixed": "bf16", "16-mixed": "fp16"}
# (vocabulary, width, layers, heads, sequence length, batch, warmup steps, repeats, steps per repeat)
SIZES = {"mid": (8192, 512, 6, 8, 256, 16, 10, 5, 20), "smoke": (128, 32, 1, 2, 16, 4, 1, 2, 2)}
NO_GPU = (
    "cuda_precision.py: no CUDA GPU is visible (torch.cuda.is_available() is False), so there is nothing to "
    "measure. Run it on a machine with a GPU, or pass --device cpu --smoke to check the code paths on the CPU."
)


def make_model(size: str) -> Any:
    """Embedding, a stack of transformer encoder layers, and a head back to the vocabulary."""
    from torch import nn

    vocab, width, layers, heads = SIZES[size][:4]
    layer = nn.TransformerEncoderLayer(width, heads, dim_feedforward=4 * width, batch_first=True, dropout=0.0)
    return nn.Sequential(nn.Embedding(vocab, width), nn.TransformerEncoder(layer, layers), nn.Linear(width, vocab))


def _raw(model: Any, optimizer: Any, precision: str, device: str) -> tuple[Callable, Callable[[Any], None], Any]:
    """(forward context, backward, step) for raw torch at `precision`."""
    import torch

    if precision == "32-true":
        return nullcontext, lambda loss: loss.backward(), optimizer.step
    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float16

    def autocast() -> AbstractContextManager:
        return torch.autocast(device, dtype=dtype)

    if precision == "bf16-mixed":
        return autocast, lambda loss: loss.backward(), optimizer.step
    scaler = torch.amp.GradScaler(device)

    def step() -> None:
        scaler.step(optimizer)
        scaler.update()

    return autocast, lambda loss: scaler.scale(loss).backward(), step


def _build(framework: str, precision: str, device: str, size: str) -> tuple[Callable[[Any, Any], None], Any]:
    """Set up model and AdamW with `framework` at `precision`; return one training step and the model."""
    import torch
    from torch.nn.functional import cross_entropy

    torch.manual_seed(0)
    model: Any = make_model(size)
    context: Callable[[], AbstractContextManager] = nullcontext
    if framework == "raw":
        model = model.to(device)
        optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-4)
        context, backward, step = _raw(model, optimizer, precision, device)
    elif framework == "accelerate":
        from accelerate import Accelerator

        acc = Accelerator(cpu=device == "cpu", mixed_precision=ACCELERATE_NAMES[precision])
        model, optimizer = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        backward, step = acc.backward, optimizer.step
    else:
        accelerator = "cuda" if device == "cuda" else "cpu"
        fab = __import__(framework).Fabric(accelerator=accelerator, devices=1, precision=precision)
        model, optimizer = fab.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-4))
        backward, step = fab.backward, optimizer.step

    def train_step(tokens: Any, targets: Any) -> None:
        optimizer.zero_grad(set_to_none=True)
        with context():  # raw mixed precision: autocast around forward and loss, as the AMP recipe says
            logits = model(tokens)
            loss = cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        backward(loss)
        step()

    return train_step, model


def worker(framework: str, precision: str, device: str, size: str) -> None:
    """Runs in a fresh process: warm up, time repeats of steps, print per-step seconds and peak memory."""
    import torch

    vocab, _, _, _, seq, batch, warmup, repeats, steps = SIZES[size]
    if device == "cpu":
        torch.set_num_threads(1)
    train_step, _ = _build(framework, precision, device, size)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    targets = torch.randint(0, vocab, (batch, seq), generator=gen).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        train_step(tokens, targets)
    sync()
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    per_step = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            train_step(tokens, targets)
        sync()  # CUDA runs asynchronously: count a step when the GPU has finished it
        per_step.append((time.perf_counter() - start) / steps)
    peak = torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else float("nan")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    emit({"per_step_s": per_step, "peak_mb": peak, "device_name": name})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="round-robin rounds (a fresh process each)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a code-path check only")
    parser.add_argument("--smoke", action="store_true", help="a tiny model and 1 round, no peers")
    parser.add_argument("--peer-python", help="interpreter with lightning-fabric and accelerate installed")
    parser.add_argument("--worker", nargs=4, metavar=("FW", "PRECISION", "DEVICE", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return 0
    if args.device == "cuda":  # on the CPU this process need not import torch (seconds): the workers run everything
        import torch

        if not torch.cuda.is_available():
            print(NO_GPU, file=sys.stderr)
            return 1
    size = "smoke" if args.smoke else "mid"
    if args.smoke:
        args.rounds = 1
        os.environ.pop("FABRIC_BENCH_PEER_PYTHON", None)
    # float16 autocast is a CUDA recipe; on the CPU fabric itself would switch 16-mixed to bf16-mixed.
    precisions: tuple[str, ...] = PRECISIONS if args.device == "cuda" else ("32-true", "bf16-mixed")
    if args.smoke and args.device == "cpu":
        precisions = ("bf16-mixed",)  # the autocast paths; keeps the check quick
    contenders = common_contenders("raw torch", None if args.smoke else args.peer_python)
    if args.smoke:  # a check of fabric's code paths: peers installed here would only add their start-up time
        contenders = [c for c in contenders if c[2] in ("raw", "fabric")]
    for precision in precisions:
        _measure(contenders, precision, args.device, size, args.rounds)
    return 0


def _measure(contenders: list, precision: str, device: str, size: str, rounds: int) -> None:
    """Run every contender at one precision, round-robin; print time and memory tables."""
    times: dict[str, list[float]] = {c[0]: [] for c in contenders}
    peaks: dict[str, list[float]] = {c[0]: [] for c in contenders}
    gpu = ""
    for r in range(rounds):
        k = r % len(contenders)
        for label, py, fw, _ in contenders[k:] + contenders[:k]:
            data, _ = run_json(py, [__file__, "--worker", fw, precision, device, size])
            times[label] += data["per_step_s"]
            peaks[label].append(data["peak_mb"])
            gpu = data["device_name"]
    vocab, width, layers, heads, seq, batch, _, repeats, steps = SIZES[size]
    what = f"transformer {layers}x{width} ({heads} heads, vocab {vocab}), batch {batch}x{seq} tokens, AdamW"
    rows = []
    for label, _, _, base in contenders:
        note = f"{1 / (sum(times[label]) / len(times[label])):.1f} steps/s (mean)"
        rows.append(Row(label, times[label], None if label == base else times[base], note))
    print_table(f"{precision} on {gpu}: {what}; {rounds} rounds x {repeats} x {steps} steps", rows, "ms/step", 1e3)
    if device == "cuda":
        mem = [Row(lab, peaks[lab], None if lab == base else peaks[base]) for lab, _, _, base in contenders]
        print_table(f"{precision} on {gpu}: torch.cuda.max_memory_allocated", mem, "MB")


if __name__ == "__main__":
    sys.exit(main())
