"""Whether the job's rendezvous store can be reached on this machine's other addresses, from inside a 2-rank job.

Usage: fabric run ... store_exposure.py OUTDIR ADDRESSES (`fabric run` started both processes); ADDRESSES
comma-separated non-loopback addresses of this machine. Rank 0 writes OUTDIR/probe.json: the port and, per
address (and for 127.0.0.1), connect_ex's result (0: something accepted the connection).
launch_ddp_script.py (`ddp`) and launch_function.py (`ddp_spawn`) call `probe` inside their own jobs.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from _it_common import outdir_from_argv, write_json

from fabric import Fabric


def parse_addresses(text: str) -> list[str]:
    """The comma-separated ADDRESSES argument; empty where the machine has none to probe."""
    return [address for address in text.split(",") if address]


def probe(fabric: Fabric, outdir: Path, addresses: list[str]) -> None:
    """Rank 0 tries to connect to the job's store on 127.0.0.1 and on each of ADDRESSES; OUTDIR/probe.json."""
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
    fabric = Fabric()  # every flag comes from `fabric run`
    fabric.launch()
    probe(fabric, outdir, parse_addresses(sys.argv[2]))


if __name__ == "__main__":
    main()
