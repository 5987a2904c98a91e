"""Processes started by jsrun in an IBM LSF job: ranks from JSM_NAMESPACE_*, hosts from LSB_* variables."""

from __future__ import annotations

import os
import socket
from pathlib import Path

from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.utilities.exceptions import FabricValueError

_REQUIRED = ("LSB_JOBID", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_LOCAL_RANK")


def _job_hosts() -> tuple[list[str], str]:
    """Every slot's host, in order, and the variable they came from."""
    rankfile = os.environ.get("LSB_DJOB_RANKFILE")
    if rankfile and Path(rankfile).is_file():
        lines = Path(rankfile).read_text().splitlines()
        return [line.strip() for line in lines if line.strip()], "LSB_DJOB_RANKFILE"
    mcpu = os.environ.get("LSB_MCPU_HOSTS", "").split()
    if mcpu:  # "host slots host slots ..."
        pairs = zip(mcpu[::2], mcpu[1::2], strict=False)
        return [host for host, slots in pairs for _ in range(int(slots))], "LSB_MCPU_HOSTS"
    return os.environ.get("LSB_HOSTS", "").split(), "LSB_HOSTS"


def _compute_hosts() -> tuple[list[str], str]:
    """Unique compute hosts in job order; the first host is the launch (batch) node and is skipped."""
    hosts, source = _job_hosts()
    unique = list(dict.fromkeys(hosts))
    return (unique[1:] if len(unique) > 1 else unique), source


class LSFEnvironment(ClusterEnvironment):
    """Reads LSB_JOBID, LSB_DJOB_RANKFILE (or LSB_MCPU_HOSTS / LSB_HOSTS) and jsrun's JSM_NAMESPACE_* variables."""

    @property
    def creates_processes_externally(self) -> bool:
        """jsrun started every process."""
        return True

    @property
    def main_address(self) -> str:
        """MASTER_ADDR, else the first compute host (the launch node runs no task)."""
        if os.environ.get("MASTER_ADDR"):
            return os.environ["MASTER_ADDR"]
        hosts, _ = _compute_hosts()
        if not hosts:
            raise RuntimeError(
                "LSFEnvironment: no hosts found in LSB_DJOB_RANKFILE, LSB_MCPU_HOSTS or LSB_HOSTS, so the main "
                "address is unknown. Run inside an LSF job (bsub), or set MASTER_ADDR."
            )
        return hosts[0]

    @property
    def main_port(self) -> int:
        """MASTER_PORT, else 10000 + LSB_JOBID % 1000, so every task agrees without talking."""
        if os.environ.get("MASTER_PORT"):
            return int(os.environ["MASTER_PORT"])
        return 10000 + int(os.environ["LSB_JOBID"]) % 1000

    @staticmethod
    def detect() -> bool:
        """Inside an LSF job (LSB_JOBID) and started by jsrun (JSM_NAMESPACE_RANK, _SIZE, _LOCAL_RANK)."""
        return all(name in os.environ for name in _REQUIRED)

    def world_size(self) -> int | None:
        """JSM_NAMESPACE_SIZE."""
        return int(os.environ["JSM_NAMESPACE_SIZE"])

    def global_rank(self) -> int | None:
        """JSM_NAMESPACE_RANK."""
        return int(os.environ["JSM_NAMESPACE_RANK"])

    def local_rank(self) -> int:
        """JSM_NAMESPACE_LOCAL_RANK."""
        return int(os.environ["JSM_NAMESPACE_LOCAL_RANK"])

    def node_rank(self) -> int:
        """This host's position among the compute hosts."""
        hosts, source = _compute_hosts()
        hostname = socket.gethostname()
        if hostname in hosts:
            return hosts.index(hostname)
        short = [host.split(".")[0] for host in hosts]  # the rank file may hold short names, the host an FQDN
        if hostname.split(".")[0] in short:
            return short.index(hostname.split(".")[0])
        raise RuntimeError(
            f"LSFEnvironment: this host ({hostname}) is not among the job's compute hosts {hosts} ({source}). "
            "Start the processes with jsrun inside the bsub job, so that each runs on one of its hosts."
        )

    def processes_per_node(self) -> int | None:
        """JSM_NAMESPACE_SIZE spread evenly over the compute hosts, when it divides."""
        hosts, _ = _compute_hosts()
        size = self.world_size()
        if not hosts or size is None or size % len(hosts):
            return None
        return size // len(hosts)

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """num_nodes must be the number of compute hosts, and devices x num_nodes the jsrun world size."""
        hosts, source = _compute_hosts()
        if hosts and len(hosts) != num_nodes:
            raise FabricValueError(
                f"Fabric(num_nodes={num_nodes}): the LSF job has {len(hosts)} compute hosts ({source}: "
                f"{', '.join(hosts)}). Pass num_nodes={len(hosts)}, or request {num_nodes} nodes (bsub -nnodes)."
            )
        size = self.world_size()
        if size is not None and size != num_devices * num_nodes:
            raise FabricValueError(
                f"Fabric(devices={num_devices}, num_nodes={num_nodes}): jsrun started {size} processes "
                f"(JSM_NAMESPACE_SIZE={size}), not {num_devices} x {num_nodes}. Pass devices={size // num_nodes}"
                " or 'auto', or start one process per device with jsrun."
            )
