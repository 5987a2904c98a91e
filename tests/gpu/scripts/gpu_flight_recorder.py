"""One GPU: after fabric starts its NCCL group, torch's Flight Recorder records the collectives.

Usage: python gpu_flight_recorder.py OUTDIR
Writes OUTDIR/rank0.pt: torch's version, the entries the recorder dumped after 3 all_reduces, and the recorder's
variables as fabric left them. The test also reads this process's stderr for torch's deprecation warning.
"""

from __future__ import annotations

import os
import pickle

import _gpu_paths  # noqa: F401  (puts tests/integration/scripts on the path)
import torch
import torch.distributed as dist
from _it_common import outdir_from_argv

from fabric import Fabric

NAMES = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT")


def main() -> None:
    outdir = outdir_from_argv()
    fabric = Fabric(accelerator="cuda", strategy="ddp", devices=1)
    fabric.launch()
    tensor = torch.ones(4, device=fabric.device)
    for _ in range(3):
        fabric.all_reduce(tensor)
    torch.cuda.synchronize()
    dump = pickle.loads(torch._C._distributed_c10d._dump_nccl_trace())
    ops = [entry.get("profiling_name", "") for entry in dump.get("entries", [])]
    results = {"torch": torch.__version__, "ops": ops, "env": {name: os.environ.get(name) for name in NAMES}}
    torch.save(results, outdir / "rank0.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
