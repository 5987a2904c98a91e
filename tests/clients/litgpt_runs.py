"""litgpt 0.5.13 on fabric, end to end through litgpt's own command line, on 1 and 2 processes.

    python tests/clients/litgpt_runs.py --workdir DIR     # in an environment with litgpt and lightning installed

The chain a user runs: `pretrain` a tiny GPT (with checkpoints and a resume), `convert_pretrained_checkpoint`,
`finetune_lora` on an instruction file, `merge_lora`. fabric runs it through tests/clients/litgpt_cli.py (only the
import aliasing of lightning_alias.py); Lightning Fabric runs it through the installed `litgpt` command. Checked:

- 1 process: fabric's logged metrics and saved weights equal Lightning's, for pretraining, LoRA and the merge.
- 2 processes (litgpt picks FSDP for pretraining and FSDP2 through ModelParallelStrategy for LoRA; Lightning refuses
  both on CPU, so fabric is compared with itself): the pretrained weights equal the 1-process run's to 1e-5 (the
  data module feeds both the same global batches); a run resumed mid-epoch from a step checkpoint (model,
  optimizer and the data loader's position) ends with the uninterrupted run's weights and metrics; only rank 0
  writes logs; LoRA trains and merges, changing exactly the LoRA-targeted weights.

litgpt compiles the model with torch.compile; TORCHDYNAMO_DISABLE=1 keeps it eager in every run (compiling on 2
CPU cores would take minutes and exercise torch's compiler, not fabric).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import litgpt_assets as assets  # noqa: E402

# Logged values that depend on timing, not on the computation (ThroughputMonitor's rates among them).
TIMED = ("time", "iter_time", "remaining_time", "device/", "per_sec")
RESULTS: list[tuple[str, float, str]] = []


class Mismatch(AssertionError):
    pass


def litgpt(backend: str, work: Path, name: str, *args: str) -> None:
    """One litgpt CLI command; its output goes to WORK/NAME.log, which is printed if it fails."""
    if backend == "fabric":
        command = [sys.executable, str(HERE / "litgpt_cli.py"), *args]
    else:
        command = [str(Path(sys.executable).parent / "litgpt"), *args]
    env = dict(
        os.environ, TORCHDYNAMO_DISABLE="1", PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    )
    log = work / f"{name}.log"
    start = time.perf_counter()
    with log.open("w") as out:
        code = subprocess.run(command, cwd=work, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=600).returncode
    RESULTS.append((name, time.perf_counter() - start, "ok" if code == 0 else f"exit {code}"))
    if code != 0:
        print(log.read_text()[-6000:])
        raise Mismatch(f"{name}: `{' '.join(command)}` exited with {code} (log above, and in {log})")


def metrics(run: Path) -> list[dict[str, str]]:
    versions = sorted((run / "logs" / "csv").iterdir())
    if [v.name for v in versions] != ["version_0"]:
        raise Mismatch(
            f"{run}: expected one logger directory version_0 (rank 0 logs), found {[v.name for v in versions]}"
        )
    with (versions[0] / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    # Empty cells are columns another row filled: compare what each row logged.
    return [{k: v for k, v in row.items() if v and not any(t in k for t in TIMED)} for row in rows]


def same_metrics(name: str, ours: list[dict[str, str]], theirs: list[dict[str, str]]) -> None:
    if ours != theirs:
        pairs = enumerate(zip(ours, theirs, strict=True)) if len(ours) == len(theirs) else iter(())
        diff = next(((i, a, b) for i, (a, b) in pairs if a != b), None)
        raise Mismatch(
            f"{name}: logged metrics differ ({len(ours)} vs {len(theirs)} rows); first differing row: {diff}"
        )
    print(f"  {name}: {len(ours)} rows of logged metrics equal")


def weights(path: Path) -> dict[str, torch.Tensor]:
    """The model's tensors in a litgpt checkpoint file (a whole training state or a bare state dict)."""
    # Not weights_only: Lightning's checkpoint pickles litgpt's DataLoader whole (fabric saves its position).
    state = torch.load(path, map_location="cpu", weights_only=False)
    return state.get("model", state)


def close_weights(name: str, ours_path: Path, theirs_path: Path, atol: float) -> None:
    ours, theirs = weights(ours_path), weights(theirs_path)
    if ours.keys() != theirs.keys():
        raise Mismatch(f"{name}: different parameter names: {sorted(set(ours) ^ set(theirs))[:5]}")
    worst = max((ours[k].float() - theirs[k].float()).abs().max().item() for k in ours)
    if worst > atol:
        raise Mismatch(f"{name}: weights differ by up to {worst:.3g} (allowed {atol})")
    print(f"  {name}: {len(ours)} tensors, max abs difference {worst:.3g} (allowed {atol})")


def pretrain(work: Path) -> None:
    common = ["pretrain", "--config", "pretrain.yaml", "--tokenizer_dir", "tokenizer"]
    start = [*common, "--initial_checkpoint_dir", "init"]
    litgpt("fabric", work, "pretrain-fabric-1", *start, "--devices", "1", "--out_dir", "pre/f1")
    litgpt("lightning", work, "pretrain-lightning-1", *start, "--devices", "1", "--out_dir", "pre/l1")
    litgpt("fabric", work, "pretrain-fabric-2", *start, "--devices", "2", "--out_dir", "pre/f2")
    resume = ["--resume", "pre/f2/step-00000002/lit_model.pth"]
    litgpt("fabric", work, "pretrain-fabric-2-resumed", *common, "--devices", "2", "--out_dir", "pre/f2r", *resume)
    pre = work / "pre"
    same_metrics("pretrain 1 process, fabric vs Lightning", metrics(pre / "f1"), metrics(pre / "l1"))
    close_weights(
        "pretrain 1 process, fabric vs Lightning", pre / "f1/final/lit_model.pth", pre / "l1/final/lit_model.pth", 0.0
    )
    close_weights(
        "pretrain 2 processes (FSDP) vs 1 process", pre / "f2/final/lit_model.pth", pre / "f1/final/lit_model.pth", 1e-5
    )
    resumed, straight = metrics(pre / "f2r"), metrics(pre / "f2")
    same_metrics("pretrain 2 processes, resumed at step 2 vs uninterrupted", resumed, straight[-len(resumed) :])
    close_weights(
        "pretrain 2 processes, resumed vs uninterrupted",
        pre / "f2r/final/lit_model.pth",
        pre / "f2/final/lit_model.pth",
        0.0,
    )


def lora(work: Path) -> None:
    litgpt("fabric", work, "convert-pretrained", "convert_pretrained_checkpoint", "pre/f1/final", "base")
    common = [
        "finetune_lora", "base", "--data", "JSON", "--data.json_path", "instructions.json",
        "--data.val_split_fraction", "0.25", "--data.num_workers", "0", "--precision", "32-true",
        "--train.epochs", "1", "--train.max_steps", "3",
        "--train.global_batch_size", "4", "--train.micro_batch_size", "2",
        "--train.max_seq_length", "64", "--train.save_interval", "2", "--train.lr_warmup_steps", "1",
        "--eval.interval", "2", "--eval.max_iters", "2", "--eval.max_new_tokens", "2",
    ]  # fmt: skip
    litgpt("fabric", work, "lora-fabric-1", *common, "--devices", "1", "--out_dir", "lora/f1")
    litgpt("lightning", work, "lora-lightning-1", *common, "--devices", "1", "--out_dir", "lora/l1")
    # No evaluation during the 2-process run: litgpt 0.5.13 generates its example text on rank 0 alone, which under
    # FSDP2 waits forever for the other rank's parameter shards (litgpt PR #2213; with Lightning on GPUs too). The
    # run stops at max_steps, before the end of the epoch, where litgpt generates on rank 0 as well.
    litgpt("fabric", work, "lora-fabric-2", *common, "--devices", "2", "--out_dir", "lora/f2", "--eval.interval", "100")
    for run, backend in (("f1", "fabric"), ("l1", "lightning"), ("f2", "fabric")):
        litgpt(backend, work, f"merge-lora-{backend}-{run}", "merge_lora", f"lora/{run}/final")
    out = work / "lora"
    same_metrics("LoRA 1 process, fabric vs Lightning", metrics(out / "f1"), metrics(out / "l1"))
    close_weights(
        "LoRA adapters, fabric vs Lightning",
        out / "f1/final/lit_model.pth.lora",
        out / "l1/final/lit_model.pth.lora",
        0.0,
    )
    close_weights(
        "merged model, fabric vs Lightning", out / "f1/final/lit_model.pth", out / "l1/final/lit_model.pth", 0.0
    )
    base = weights(work / "base/lit_model.pth")
    for run in ("f1", "f2"):
        merged = weights(out / run / "final/lit_model.pth")
        changed = sorted(k for k in base if not torch.equal(base[k], merged[k]))
        if merged.keys() != base.keys() or not changed or any(".attn.qkv." not in k for k in changed):
            raise Mismatch(f"LoRA {run}: the merge changed {changed}; expected only the attention qkv weights")
        print(f"  LoRA {run}: the merge changed exactly {len(changed)} qkv weights")
    losses = [float(row["loss"]) for row in metrics(out / "f2") if "loss" in row]
    if len(losses) != 3 or not all(math.isfinite(loss) for loss in losses):
        raise Mismatch(f"LoRA 2 processes: expected 3 finite logged losses (max_steps 3), got {losses}")
    print(f"  LoRA 2 processes: losses {[round(loss, 4) for loss in losses]}")


def prepare(work: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    vocab_size = assets.write_tokenizer(work / "tokenizer")
    assets.write_instructions(work / "instructions.json")
    assets.write_pretrain_config(work / "pretrain.yaml", vocab_size)
    assets.write_initial_checkpoint(work / "init", vocab_size)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", type=Path, required=True, help="an empty or missing directory for all outputs")
    work = parser.parse_args(argv).workdir.resolve()
    if work.exists() and any(work.iterdir()):
        parser.error(f"--workdir {work} is not empty; litgpt refuses to overwrite its outputs")
    prepare(work)
    start = time.perf_counter()
    try:
        pretrain(work)
        lora(work)
    except Mismatch as err:
        print(f"FAILED: {err}")
        return 1
    finally:
        for name, seconds, outcome in RESULTS:
            print(f"  {name:<32} {seconds:6.1f} s  {outcome}")
    print(f"litgpt 0.5.13 on fabric: all checks passed in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
