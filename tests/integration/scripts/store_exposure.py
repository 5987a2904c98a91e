"""Whether the job's rendezvous store can be reached on this machine's other addresses, from inside a 2-rank job.

Usage: python store_exposure.py OUTDIR START ADDRESSES, START one of ddp (fabric.launch() re-runs this script),
spawn (fabric.launch(fn)) or external (`fabric run` started both processes); ADDRESSES comma-separated
non-loopback addresses of this machine. Rank 0 writes OUTDIR/probe.json: the port and, per address (and for
127.0.0.1), connect_ex's result (0: something accepted the connection).
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from _it_common import outdir_from_argv, write_json

from fabric import Fabric


def probe(fabric: Fabric, outdir: Path, addresses: list[str]) -> None:
    fabric.barrier()  # the store is up and both ranks use it
    if fabric.global_rank == 0:
        port = fabric.strategy.cluster_environment.main_port
        results = {}
        for address in ["127.0.0.1", *addresses]:
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            with socket.socket(family, socket.SOCK_STREAM) as sock:
                sock.settimeout(5)
                results[address] = sock.connect_ex((address, port))
        write_json(outdir / "probe.json", {"port": port, "results": results})
    fabric.barrier()


def main() -> None:
    outdir = outdir_from_argv()
    start, addresses = sys.argv[2], [a for a in sys.argv[3].split(",") if a]
    if start == "spawn":
        Fabric(accelerator="cpu", strategy="ddp_spawn", devices=2).launch(probe, outdir, addresses)
        return
    fabric = Fabric(accelerator="cpu", strategy="ddp", devices=2) if start == "ddp" else Fabric()
    fabric.launch()
    probe(fabric, outdir, addresses)


if __name__ == "__main__":
    main()
