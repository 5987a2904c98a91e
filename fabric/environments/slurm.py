"""Processes started by SLURM's srun: ranks, node list and port come from the SLURM_* variables."""

from __future__ import annotations

import os
import re
import signal

from fabric.environments.cluster_environment import ClusterEnvironment
from fabric.utilities.exceptions import FabricValueError

# Step ids at or above this are SLURM's special steps (batch script, interactive shell, extern), never srun tasks.
_FIRST_SPECIAL_STEP_ID = 0xFFFFFFF0
# torchrun sets these in the workers it starts; if present, torchrun (not srun) started this process.
_TORCHRUN_VARS = ("TORCHELASTIC_RUN_ID", "GROUP_RANK", "LOCAL_WORLD_SIZE")
_RANGE = re.compile(r"\[([^\]]*)\]")
_TASK_COUNT = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand SLURM's compressed host list: ``node[001-003,007],gpu-[1-2]`` -> ``node001, ..., gpu-2``."""
    hosts: list[str] = []
    for item in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_one(item))
    return hosts


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item for item in items if item]


def _expand_one(item: str) -> list[str]:
    match = _RANGE.search(item)
    if match is None:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    names: list[str] = []
    for part in match.group(1).split(","):
        first, _, last = part.partition("-")
        width = len(first)  # zero padding is kept: node[001-003] -> node001
        for number in range(int(first), int(last or first) + 1):
            names.extend(head + str(number).zfill(width) + rest for rest in _expand_one(tail))
    return names


def expand_tasks_per_node(value: str) -> list[int]:
    """Expand SLURM's task counts per node: ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in value.split(","):
        match = _TASK_COUNT.match(part.strip())
        if match is None:
            raise FabricValueError(f"cannot read the task count {part!r} in {value!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


class SLURMEnvironment(ClusterEnvironment):
    """Reads SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID, SLURM_NTASKS and the node list set by srun.

    ``auto_requeue`` and ``requeue_signal`` are stored for code that wants to requeue the job on a signal
    (as Lightning's Trainer does); fabric does not requeue. Its own handling of SIGTERM and SIGUSR1 is
    `fabric.preempted` (see docs/preemption.md).
    """

    def __init__(self, auto_requeue: bool = True, requeue_signal: signal.Signals | None = None) -> None:
        self.auto_requeue = auto_requeue
        self.requeue_signal = requeue_signal if requeue_signal is not None else getattr(signal, "SIGUSR1", None)

    @property
    def creates_processes_externally(self) -> bool:
        """srun started every process."""
        return True

    @staticmethod
    def in_job() -> bool:
        """This process runs inside a SLURM allocation (a batch script, srun task or anything they started)."""
        return "SLURM_JOB_ID" in os.environ

    @property
    def main_address(self) -> str:
        """MASTER_ADDR, else the first host of the step's node list (where srun puts task 0)."""
        if os.environ.get("MASTER_ADDR"):
            return os.environ["MASTER_ADDR"]
        for name in ("SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST"):
            if os.environ.get(name):
                return expand_hostlist(os.environ[name])[0]
        return "127.0.0.1"

    @property
    def main_port(self) -> int:
        """MASTER_PORT, else 15000 + the last four digits of SLURM_JOB_ID, so every task agrees without talking."""
        if os.environ.get("MASTER_PORT"):
            return int(os.environ["MASTER_PORT"])
        job_id = os.environ.get("SLURM_JOB_ID") or os.environ.get("SLURM_JOBID")
        return 15000 + int(job_id[-4:]) if job_id else 12910

    @staticmethod
    def detect() -> bool:
        """This process is a task of a regular srun step (not a batch script, shell, or torchrun worker)."""
        env = os.environ
        step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
        if step is None or not step.isdigit() or int(step) >= _FIRST_SPECIAL_STEP_ID:
            return False  # python run directly in an sbatch script or an salloc shell: fabric launches
        if "SLURM_PTY_PORT" in env:
            return False  # an interactive `srun --pty bash`: the user runs python inside it
        if "TORCHELASTIC_RUN_ID" in env or ("GROUP_RANK" in env and "LOCAL_WORLD_SIZE" in env):
            return False  # torchrun inside an srun step: TorchElasticEnvironment handles it
        return all(name in env for name in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS"))

    def world_size(self) -> int | None:
        """SLURM_NTASKS (srun sets it to the step's task count)."""
        return int(os.environ["SLURM_NTASKS"])

    def global_rank(self) -> int | None:
        """SLURM_PROCID."""
        return int(os.environ["SLURM_PROCID"])

    def local_rank(self) -> int:
        """SLURM_LOCALID."""
        return int(os.environ["SLURM_LOCALID"])

    def node_rank(self) -> int:
        """SLURM_NODEID."""
        return int(os.environ.get("SLURM_NODEID", 0))

    def _num_nodes(self) -> tuple[int, str] | None:
        """Nodes in the step and the variable that says so."""
        for name in ("SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES"):
            if os.environ.get(name):
                return int(os.environ[name]), name
        return None

    def _tasks_on_this_node(self) -> tuple[int, str, str] | None:
        """Tasks srun started on this node, with the variable and raw value it came from."""
        for name in ("SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
            raw = os.environ.get(name)
            if raw:
                counts = expand_tasks_per_node(raw)
                return counts[min(self.node_rank(), len(counts) - 1)], name, raw
        nodes = self._num_nodes()
        if nodes is not None and os.environ.get("SLURM_NTASKS"):
            tasks = int(os.environ["SLURM_NTASKS"])
            return tasks // nodes[0], f"SLURM_NTASKS / {nodes[1]}", f"{tasks}/{nodes[0]}"
        return None

    def processes_per_node(self) -> int | None:
        """SLURM_NTASKS_PER_NODE (forms ``4`` or ``2(x3)``), else the step's tasks per node, else tasks / nodes."""
        found = self._tasks_on_this_node()
        return found[0] if found else None

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """devices must equal the tasks srun started on this node, and num_nodes the nodes of the step."""
        found = self._tasks_on_this_node()
        if found is not None and found[0] != num_devices:
            tasks, name, raw = found
            raise FabricValueError(
                f"Fabric(devices={num_devices}): srun started {tasks} tasks on this node ({name}={raw}). "
                f"Pass devices={tasks} or 'auto', or start one task per device "
                f"(srun --ntasks-per-node={num_devices})."
            )
        nodes = self._num_nodes()
        if nodes is not None and nodes[0] != num_nodes:
            raise FabricValueError(
                f"Fabric(num_nodes={num_nodes}): srun runs on {nodes[0]} nodes ({nodes[1]}={nodes[0]}). "
                f"Pass num_nodes={nodes[0]}, or request {num_nodes} nodes (sbatch --nodes={num_nodes})."
            )
